"""Several client processes hammering one small pool: every read is the right bytes or a miss."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from maru_pool import PoolClient
from tests.support.pool import START_TIMEOUT_S, Daemon, connector_env, start_serve

WORKER = textwrap.dedent(
    """
    import random, sys, hashlib
    from maru_pool import PoolClient, PoolFull

    def payload(i):
        # Deterministic per key and of varying size, so any mix-up of keys or offsets shows.
        seed = hashlib.sha256(str(i).encode()).digest()
        return (seed * (1 + (i * 7919) % 3000))[: 4096 + (i * 104729) % 200_000]

    url, seed, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    client = PoolClient(url, timeout_s=10)
    hits = stores = 0
    for _ in range(ops):
        i = rng.randrange(60)
        key = i.to_bytes(32, "big")
        action = rng.random()
        if action < 0.4:
            try:
                stores += client.put(key, payload(i))
            except PoolFull:
                pass
        elif action < 0.8:
            expected = payload(i)
            out = bytearray(len(expected))
            if client.get_into(key, out):
                assert out == expected, f"key {i}: wrong bytes"
                hits += 1
        else:
            keys = [j.to_bytes(32, "big") for j in range(i, min(i + 8, 60))]
            pins = [p for p in client.open_read_many(keys) if p is not None]
            for j in rng.sample(range(60), 4):  # churn while holding the pins: they must not move
                try:
                    client.put(j.to_bytes(32, "big"), payload(j))
                except PoolFull:
                    pass
            for p in pins:
                p.verify()
                assert bytes(p.buffer) == payload(int.from_bytes(p.key, "big"))
            client.release_many(pins)
    print(hits, stores)
    """
)


def test_concurrent_clients_never_see_wrong_bytes(daemons: list[Daemon], sock_dir: Path) -> None:
    # 2 MiB holds ~20 of the ~100 KiB payloads: constant eviction under three writers and readers.
    d = start_serve(daemons, sock_dir, size="2Mi")
    url = d.ready["listen"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, url, str(seed), "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=connector_env(),
        )
        for seed in range(3)
    ]
    results = [p.communicate(timeout=START_TIMEOUT_S * 4) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    hits = sum(int(out.split()[0]) for out, _ in results)
    assert hits > 0  # the test exercised reads, not only misses
    stats = PoolClient(url, timeout_s=5).stats()
    assert stats["evictions"] > 0 and stats["pins"] == 0 and stats["writing"] == 0
    assert stats["errors"] == 0
