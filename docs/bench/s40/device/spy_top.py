import gzip, sys, collections
path = sys.argv[1]; nshow = int(sys.argv[2]) if len(sys.argv) > 2 else 50
incl = collections.Counter(); self_ = collections.Counter(); total = 0
for line in gzip.open(path, 'rt'):
    stack, _, n = line.rstrip().rpartition(" ")
    if not n.isdigit() or 'MainThread' not in stack.split(';')[0]: continue
    n = int(n); frames = stack.split(';')[1:]; total += n
    for f in set(frames): incl[f] += n
    if frames: self_[frames[-1]] += n
print("total", total, "samples =", total/50, "s")
for f, n in incl.most_common(nshow): print(f"{n/total*100:5.1f}% {f[:150]}")
print("--- self")
for f, n in self_.most_common(25): print(f"{n/total*100:5.1f}% {f[:150]}")
