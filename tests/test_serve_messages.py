"""The server protocol's named messages: torch-free (the server process never imports torch),
and they survive the pipe's pickling with their fields by name."""

from __future__ import annotations

import pickle
import subprocess
import sys

from strata.serve.messages import Accepted, OutputRow, Outputs, Submit


def test_messages_module_imports_no_torch():
    code = ("import sys, strata.serve.messages, strata.serve.supervisor, strata.kinds, "
            "strata.metrics; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_messages_round_trip_by_name():
    row = OutputRow("r1", [1, 2], "ab", True, "length", None, 5, 2, {"queue_s": 0.1})
    for msg in (Submit("r1", {"prompt": "x"}), Accepted("r1", 5), Outputs([row])):
        assert pickle.loads(pickle.dumps(msg)) == msg
    assert row.finish_reason == "length" and row.output_tokens == 2


def test_joined_rows_concatenate_ids_and_text_and_keep_the_latest_rest():
    a = OutputRow("r1", [1], "a", False, output_tokens=1)
    b = OutputRow("r1", [2, 3], "bc", True, "stop", None, 4, 3, {"t": 1})
    assert a.joined(b) == OutputRow("r1", [1, 2, 3], "abc", True, "stop", None, 4, 3, {"t": 1})
