"""Library code of the command-line tools in scripts/ (each script is a thin main over a module
here, so tests import the package rather than scripts by path)."""
