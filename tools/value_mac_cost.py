#!/usr/bin/env python3
"""The cost of the Redis value header's checks per GiB: the xxh3 checksum alone (no MAC key) and
the keyed BLAKE3 MAC (mac_key_env set), each for packing a header (a store) and checking a value
(a load), on one thread, in-process (no Redis: the network is not what is measured).

    PYTHONPATH=src python tools/value_mac_cost.py [--mib 256] [--value-kib 1024] [--repeats 5]

Prints one JSON line per (codec, operation): GiB/s (median of the repeats) and seconds per GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kvport.connectors.offloading.tiers.value_format import ValueCodec, Verdict, derive_mac_key


def measure(codec: ValueCodec, payloads: list[bytes], repeats: int) -> dict[str, float]:
    key = b"k" * 32
    values = [codec.pack_header(key, p) + p for p in payloads]
    total = sum(len(p) for p in payloads)
    pack, check = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for p in payloads:
            codec.pack_header(key, p)
        pack.append(total / (time.perf_counter() - start) / (1 << 30))
        start = time.perf_counter()
        for v, p in zip(values, payloads):
            assert codec.check(key, v, len(p)) is Verdict.OK
        check.append(total / (time.perf_counter() - start) / (1 << 30))
    return {"pack_gib_s": statistics.median(pack), "check_gib_s": statistics.median(check)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="payload MiB per repeat")
    parser.add_argument("--value-kib", type=int, default=1024, help="one value's payload KiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = max(1, args.mib * 1024 // args.value_kib)
    payloads = [os.urandom(args.value_kib * 1024) for _ in range(n)]
    digest = bytes(32)
    for name, codec in (("xxh3 (no MAC key)", ValueCodec(digest)),
                        ("keyed blake3 MAC", ValueCodec(digest, derive_mac_key("bench")))):
        row = measure(codec, payloads, args.repeats)
        print(json.dumps({"codec": name, "value_kib": args.value_kib, "mib": args.mib, **row,
                          "pack_s_per_gib": 1 / row["pack_gib_s"],
                          "check_s_per_gib": 1 / row["check_gib_s"]}))


if __name__ == "__main__":
    main()
