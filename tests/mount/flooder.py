"""A hostile writer: N threads, each writes one buffer into its own file at once.

Run as a script (as the flooding user): ``python flooder.py DIR THREADS SIZE``. Prints
one JSON line when every thread is done: how many writes succeeded and the errno of the
others. The threads start together (a barrier), as a careless job's thread pool would.
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
    barrier = threading.Barrier(threads)

    def write(i: int) -> None:
        fd = os.open(os.path.join(directory, f"f{i:05d}"), os.O_WRONLY | os.O_CREAT, 0o644)
        barrier.wait()
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
    for t in pool:
        t.join()
    print(json.dumps(dict(results)), flush=True)


if __name__ == "__main__":
    main()
