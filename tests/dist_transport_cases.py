"""The two processes of tests/test_dist_transport.py: a prefill (rank 0) and a decode (rank 1)
with a tiny KVPool each, talking through engine/dist_transport.py over gloo on 127.0.0.1.

Each side runs a fixed script and reports what it saw on `results` as (name, value) pairs;
the test asserts on them. The parent's events order the two scripts where the transport
itself cannot (the source page overwritten before decode lands). Both sides leave with
os._exit: the script ends with a dead peer, and a process group torn down with a send
pending is not what is being tested.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

WINDOW = 3  # writes_in_flight_max
TIMEOUT_S = 5.0  # the transports' bound on waits that a live peer answers at once
SILENCE_S = 0.5  # the bound of the waits the test expects to run out
PAGE_SHAPE = dict(page_tokens=4, num_layers=2, num_kv_heads=1, head_dim=8)  # 512-byte pages
STEP_S = 20.0  # the longest a script waits for the parent's event


def pool(num_pages: int):
    from engine.pool import KVPool, PoolConfig
    return KVPool(PoolConfig(num_pages=num_pages, **PAGE_SHAPE))


def init(rank: int, port: int) -> None:
    import torch.distributed as dist

    import engine.dist_transport  # noqa: F401  (imported before the rendezvous: both sides ready)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=STEP_S))


def finish(results, code: int = 0) -> None:
    results.put(("exit", code))
    results.close()
    results.join_thread()
    os._exit(code)


def side(rank: int, script, port: int, events: dict, results) -> None:
    """One process of a pair: join the group as `rank`, run `script(events, results)`, and
    report its exception to the test (which fails on it) before exiting."""
    try:
        init(rank, port)
        script(events, results)
    except BaseException as error:  # noqa: BLE001 -- reported to the test, which fails on it
        results.put(("error", f"{type(error).__name__}: {error}"))
        finish(results, 1)
    finish(results)


def numbered_pool(pages: int):
    """A pool whose every page holds values of its own (page k: k + 1 + index / 1000)."""
    source = pool(pages)
    for page in range(pages):
        source.kv[page] = page + 1 + torch.arange(source.kv[page].numel()).reshape(
            source.kv[page].shape) / 1000
    return source


def prefill_script(events, results) -> None:
    from engine.dist_transport import DistTransport, DistTransportConfig, TransportTimeout
    from engine.transport import PageWrite, page_checksum
    source = numbered_pool(6)
    transport = DistTransport(source, DistTransportConfig(
        "prefill", 0, ((0, 1),), writes_in_flight_max=WINDOW, timeout_s=TIMEOUT_S))
    writes = [PageWrite(7, 0, 2, 40, page_checksum(source, 0), 0, 0),
              PageWrite(7, 1, 3, 41, page_checksum(source, 1), 0, 0),
              PageWrite(8, 2, 4, 42, page_checksum(source, 2), 0, 0)]
    for write in writes:
        transport.post(write)
    results.put(("posted", [tuple(w.__dict__.values()) for w in writes]))
    results.put(("in_flight_posted", transport.in_flight))
    events["ready"].wait(STEP_S)  # decode has the three headers: the writes have arrived
    source.kv[1] = 99.0  # after arrival, before the landing: the new bytes must land
    results.put(("source_at_landing", [source.kv[0].tolist(), source.kv[1].tolist()]))
    started = time.monotonic()
    try:  # the window is full and decode lands nothing yet: a bounded wait, then an error
        transport.post(PageWrite(8, 3, 5, 43, page_checksum(source, 3), 0, 0), SILENCE_S)
        results.put(("window_post", "accepted"))
    except TransportTimeout as error:
        results.put(("window_post", str(error)))
        results.put(("window_wait_s", time.monotonic() - started))
    events["overwritten"].set()
    completions = []
    for _ in range(10):
        completions.extend(transport.wait_completed(STEP_S))
        if len(completions) == 3:
            break
    results.put(("completions", [(tuple(c.write.__dict__.values()), c.landed, c.bytes_moved)
                                 for c in completions]))
    results.put(("in_flight_completed", transport.in_flight))
    prefill_reads_at_arrival(source, events, results)
    transport.post(PageWrite(9, 4, 6, 44, page_checksum(source, 4), 0, 0))
    events["landed_all"].wait(STEP_S)
    finish(results)  # dies with a write posted: decode's landing of it must fail in bound


def decode_script(events, results) -> None:
    from engine.dist_transport import (DistTransport, DistTransportConfig, PeerLost,
                                       TransportTimeout)
    target = pool(8)
    target.kv.fill_(-1.0)
    transport = DistTransport(target, DistTransportConfig(
        "decode", 0, ((0, 0),), writes_in_flight_max=WINDOW, timeout_s=TIMEOUT_S))
    ready = []
    for _ in range(10):
        ready.extend(transport.wait_ready(STEP_S))
        if len(ready) >= 3:
            break
    events["ready"].set()
    events["overwritten"].wait(STEP_S)
    results.put(("ready", [tuple(w.__dict__.values()) for w in ready]))
    a, b, c = ready
    results.put(("landed_bytes", [transport.land(a)]))
    try:
        transport.land(c)  # out of order: a misuse, caught before anything moves
    except AssertionError as error:
        results.put(("out_of_order", str(error)))
    results.put(("landed_bytes", [transport.land(b)]))
    transport.drop(c)
    results.put(("landed", [target.kv[2].tolist(), target.kv[3].tolist()]))
    results.put(("verify", target.verify([2, 3], [a.checksum, b.checksum]).tolist()))
    results.put(("dropped_page_untouched", bool((target.kv[4] == -1.0).all())))
    results.put(("counts", (transport.writes_landed, transport.bytes_landed,
                            transport.writes_dropped, transport.in_flight)))
    decode_reads_at_arrival(target, events, results)
    late = []
    for _ in range(10):
        late.extend(transport.wait_ready(STEP_S))
        if late:
            break
    events["landed_all"].set()  # the prefill now exits with this write's page never sent
    events["prefill_gone"].wait(STEP_S)  # set by the test once the prefill process has ended
    started = time.monotonic()
    try:  # silence: the headers' receives were posted before it died, and nothing comes
        transport.wait_ready(SILENCE_S)
        results.put(("silence", "a write came"))
    except TransportTimeout as error:
        results.put(("silence", str(error)))
        results.put(("silence_wait_s", time.monotonic() - started))
    for attempt in range(2):  # posting the page's receive finds the connection closed
        try:
            transport.land(late[0])
            results.put(("land_dead_peer", "landed"))
        except PeerLost as error:
            results.put((f"land_dead_peer_{attempt}", str(error)))
    results.put(("late", [tuple(w.__dict__.values()) for w in late]))
    finish(results)


def arrival_transport(kv, role: str, peer_rank: int, read_at: str = "landing"):
    """A second transport on a group of its own (tags are per group), reading at arrival."""
    import torch.distributed as dist

    from engine.dist_transport import DistTransport, DistTransportConfig
    group = dist.new_group([0, 1], backend="gloo")
    return DistTransport(kv, DistTransportConfig(role, 0, ((0, peer_rank),), WINDOW, TIMEOUT_S,
                                                 read_at=read_at), group=group)


def prefill_reads_at_arrival(source, events, results) -> None:
    from engine.dist_transport import TransportError
    from engine.transport import PageWrite, page_checksum
    transport = arrival_transport(source, "prefill", 1)
    write = PageWrite(10, 5, 7, 45, page_checksum(source, 5), 0, 0)
    transport.post(write)
    results.put(("arrival_source", source.kv[5].tolist()))
    events["arrived"].wait(STEP_S)  # decode has its header, and so posted its receive
    transport.wait_read(write)  # the page's bytes have left this process
    source.kv[5] = 77.0
    events["overwritten_after_read"].set()
    completions = []
    for _ in range(10):
        completions.extend(transport.wait_completed(STEP_S))
        if completions:
            break
    results.put(("arrival_completions", [(c.landed, c.bytes_moved) for c in completions]))
    transport.close()
    events["prefill_closed"].set()
    events["decode_closed"].wait(STEP_S)
    for _ in range(int(STEP_S / 0.01)):  # the decode's CLOSE, bounded
        transport.completed()
        if transport.peers[0].closed:
            break
        time.sleep(0.01)
    try:
        transport.post(PageWrite(11, 0, 0, 46, 0, 0, 0))
        results.put(("post_after_close", "accepted"))
    except TransportError as error:
        results.put(("post_after_close", str(error)))


def decode_reads_at_arrival(target, events, results) -> None:
    transport = arrival_transport(target, "decode", 0, read_at="arrival")
    ready = []
    for _ in range(10):
        ready.extend(transport.wait_ready(STEP_S))
        if ready:
            break
    events["arrived"].set()
    events["overwritten_after_read"].wait(STEP_S)
    (write,) = ready
    transport.land(write)
    results.put(("arrival_landed", target.kv[7].tolist()))
    results.put(("arrival_verify", target.verify([7], [write.checksum]).tolist()))
    events["prefill_closed"].wait(STEP_S)
    for _ in range(int(STEP_S / 0.01)):  # the prefill's CLOSE, bounded
        results_ready = transport.ready()
        if transport.peers[0].closed:
            break
        time.sleep(0.01)
    results.put(("closed_seen", (transport.peers[0].closed, results_ready)))
    transport.close()
    events["decode_closed"].set()


# -- batches: post_many / land_many (tests/test_dist_transport.py's `batch_pair`) -----------

BATCH_WINDOW, BATCH_MAX = 4, 3  # a post of 4 writes is two header messages: 3 + 1


def batch_transport(kv, role: str, peer_rank: int):
    from engine.dist_transport import DistTransport, DistTransportConfig
    return DistTransport(kv, DistTransportConfig(role, 0, ((0, peer_rank),), BATCH_WINDOW,
                                                 TIMEOUT_S, batch_max=BATCH_MAX))


def batch_prefill_script(events, results) -> None:
    from engine.dist_transport import TransportTimeout
    from engine.transport import PageWrite, page_checksum
    source = numbered_pool(10)
    transport = batch_transport(source, "prefill", 1)
    writes = [PageWrite(20 + p // 2, p, p, 50 + p, page_checksum(source, p), 0, 0)
              for p in range(5)]
    started = time.monotonic()
    try:  # five writes, a window of four: four go out (two messages), the fifth waits
        transport.post_many(writes, SILENCE_S)
        results.put(("b_window", "accepted"))
    except TransportTimeout as error:
        results.put(("b_window", str(error)))
        results.put(("b_window_wait_s", time.monotonic() - started))
    results.put(("b_in_flight_posted", transport.in_flight))
    results.put(("b_posted", [tuple(w.__dict__.values()) for w in writes[:4]]))
    events["b_ready"].wait(STEP_S)  # decode has the four headers
    source.kv[1] = 99.0  # after arrival, before the batch lands: page 1's new bytes land
    events["b_overwritten"].set()
    completions = []
    for _ in range(10):
        completions.extend(transport.wait_completed(STEP_S))
        if len(completions) == 4:
            break
    results.put(("b_completions", [(c.write.source_page, c.landed, c.bytes_moved)
                                   for c in completions]))
    # two writes into one decode page in one batch: they land in posting order
    twice = [PageWrite(30, p, 6, 60, page_checksum(source, p), 0, 0) for p in (5, 6)]
    transport.post_many(twice)
    results.put(("b_twice_sources", [source.kv[5].tolist(), source.kv[6].tolist()]))
    completions = []
    for _ in range(10):
        completions.extend(transport.wait_completed(STEP_S))
        if len(completions) == 2:
            break
    results.put(("b_twice_completions", [(c.write.source_page, c.landed) for c in completions]))
    late = [PageWrite(31, p, p, 70 + p, page_checksum(source, p), 0, 0) for p in (7, 8, 9)]
    transport.post_many(late)
    events["b_landed_all"].wait(STEP_S)
    finish(results)  # dies with a batch posted: decode's landing of it must fail, all of it


def wait_for(transport, count: int) -> list:
    ready = []
    for _ in range(10):
        ready.extend(transport.wait_ready(STEP_S))
        if len(ready) >= count:
            break
    return ready


def batch_decode_script(events, results) -> None:
    from engine.dist_transport import PeerLost
    target = pool(10)
    target.kv.fill_(-1.0)
    transport = batch_transport(target, "decode", 0)
    ready = wait_for(transport, 4)
    events["b_ready"].set()
    events["b_overwritten"].wait(STEP_S)
    results.put(("b_ready", [tuple(w.__dict__.values()) for w in ready]))
    try:  # the second before the first: a misuse, caught before anything moves
        transport.land_many(ready[1:3])
    except AssertionError as error:
        results.put(("b_out_of_order", str(error)))
    results.put(("b_landed_bytes", transport.land_many(ready[:3])))
    transport.drop(ready[3])
    results.put(("b_verify", target.verify([0, 1, 2], [w.checksum for w in ready[:3]]).tolist()))
    results.put(("b_dropped_untouched", bool((target.kv[3] == -1.0).all())))
    results.put(("b_counts", (transport.writes_landed, transport.writes_dropped,
                              transport.in_flight)))
    twice = wait_for(transport, 2)
    results.put(("b_twice_bytes", transport.land_many(twice)))
    results.put(("b_twice_landed", target.kv[6].tolist()))
    results.put(("b_twice_verify", target.verify([6], [twice[1].checksum]).tolist()))
    late = wait_for(transport, 3)
    events["b_landed_all"].set()  # the prefill now exits with this batch's pages never sent
    events["b_prefill_gone"].wait(STEP_S)  # set by the test once the prefill has ended
    for attempt in range(2):
        try:
            transport.land_many(late)
            results.put(("b_land_dead_peer", "landed"))
        except PeerLost as error:
            results.put((f"b_lost_{attempt}", (str(error), [w.source_page for w in error.writes],
                                               error.landed)))
    results.put(("b_late", [w.source_page for w in late]))
    results.put(("b_in_flight_after_loss", transport.in_flight))
    finish(results)
