"""A hostile writer: N threads, each writes one buffer into its own file at once.

Run as a script (as the flooding user): ``python flooder.py DIR THREADS SIZE``. Prints
one JSON line when every thread is done: how many writes succeeded and the errno of the
others. The threads write together (once all have opened), as a careless job's thread pool
would; an open the daemon refuses (ENFILE: the uid's share of its descriptors) is counted
and that thread stops.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter


def main() -> None:
    directory, threads, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    threading.stack_size(256 * 1024)
    data = b"\xab" * size
    results: Counter[str] = Counter()
    lock = threading.Lock()
    go = threading.Event()  # set once every thread has tried its open

    def write(i: int) -> None:
        try:
            fd = os.open(os.path.join(directory, f"f{i:05d}"), os.O_WRONLY | os.O_CREAT, 0o644)
        except OSError as exc:  # the daemon's share of descriptors for this uid is full
            with lock:
                results[f"open: {os.strerror(exc.errno or 0)}"] += 1
            return
        go.wait()
        try:
            n = os.write(fd, data)
            outcome = "ok" if n == size else f"short:{n}"
        except OSError as exc:
            outcome = os.strerror(exc.errno or 0)
        try:
            os.close(fd)
        except OSError as exc:
            outcome += f", close: {os.strerror(exc.errno or 0)}"
        with lock:
            results[outcome] += 1

    pool = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    go.set()  # the threads that opened a file write at once, together
    for t in pool:
        t.join()
    print(json.dumps(dict(results)), flush=True)


if __name__ == "__main__":
    main()
