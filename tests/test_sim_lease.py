"""Decode's transfer timer in the simulator is a lease (sim/lease.py): a healthy prefill
behind a long queue is never timed out, and a crashed one is, within about the lease."""

from __future__ import annotations

import pytest

from sim.run import Simulation, fault_free, result_of
from sim.scenario import Scenario, ScenarioError, scenario_from_dict

# One prefill worker computes 64-token prompts at 80 tokens/s: 0.8 s each, in chunks of
# 16 tokens (0.2 s), longer than the lease. A burst of 20 requests is reserved at once (the
# decode pool holds them all), so the last waits ~15 s behind the others: 15 backstops and
# 30 leases of queueing.
LEASE_S, BACKSTOP_S, COMPUTE_S, CHUNK_S = 0.5, 1.0, 0.8, 0.2
BURST = 20


def _slow_prefill(requests: int = BURST, prefill_pool_pages: int = 8, **faults) -> Scenario:
    return Scenario(faults=faults,
        name="slow-prefill", requests=requests,
        cluster=dict(prefill_workers=1, decode_workers=1, page_tokens=16,
                     prefill_pool_tokens=16 * prefill_pool_pages,
                     decode_pool_tokens=16 * 4 * requests,
                     context_tokens=16 * 8),
        workload=dict(prompt=dict(distribution="fixed", median_tokens=64),
                      output=dict(distribution="fixed", median_tokens=4)),
        compute=dict(prefill_tokens_per_s=64 / COMPUTE_S, prefill_chunk_tokens=16),
        timeouts=dict(lease_s=LEASE_S, transfer_timeout_s=BACKSTOP_S))


def _watched(sc: Scenario) -> tuple[Simulation, dict]:
    """A simulation and, per action, the times of its events by request."""
    times: dict[str, dict[int, list[float]]] = {}

    def seen(event, change) -> None:
        times.setdefault(event.action, {}).setdefault(event.request, []).append(sim.env.now)

    sim = Simulation(sc, on_commit=seen)
    return sim, times


def _burst(sim: Simulation) -> None:
    """Every request of the scenario arrives now; the run goes on until nothing is left."""
    for _ in range(sim.requests_total):
        sim.new_request()
    sim.env.run()


def _every_page_back(sim: Simulation) -> None:
    cluster = sim.cluster
    assert not cluster.rows
    assert all(len(free) == cluster.model.decode_pages for free in cluster.decode_free)
    assert all(len(free) == cluster.model.prefill_pages for free in cluster.prefill_free)
    assert not any(cluster.writes_into)


def test_a_healthy_prefill_behind_a_long_queue_is_never_timed_out():
    # The burst arrives through the scenario's own workload, and the run's result carries
    # the simulator's FittingRequestsSucceed watch (fault-free: every fitting prompt Ok).
    sc = _slow_prefill().with_options(workload=dict(
        arrival="bursty", burst_size=BURST, rate_per_s=100.0,
        prompt=dict(distribution="fixed", median_tokens=64),
        output=dict(distribution="fixed", median_tokens=4)))
    assert fault_free(sc)
    sim, times = _watched(sc)
    schedules = []
    schedule = sim.clock.schedule
    sim.clock.schedule = lambda r, at: (schedules.append(r), schedule(r, at))
    sim.run()
    result = result_of(sc, sim.folder, sim.refusals, None, sim.finished.triggered)
    assert result["violations"] == {}, result["first_violations"]
    assert result["summary"]["outcomes"] == {"Ok": BURST} and "Timeout" not in times
    waited_s = max(times["Accept"][r][0] - times["Reserve"][r][0] for r in range(BURST))
    assert waited_s > 15 * BACKSTOP_S and waited_s > 30 * LEASE_S
    # Renewals schedule nothing: a timer is armed again about once a lease it waits.
    assert len(schedules) <= BURST * (waited_s / LEASE_S + 2)
    _every_page_back(sim)


def test_a_request_waiting_for_a_busy_nic_is_neither_silent_nor_past_its_backstop():
    # Compute is quick (10 ms a prompt) and the NIC slow: one write at a time, 0.25 s a page,
    # 1 s a request. The prefill pool holds every prompt, so the sixth request, computed at
    # ~0.06 s, starts its writes ~5 s later: nine leases of waiting for the NIC, and three
    # backstops past its Admit.
    sc = _slow_prefill(requests=6, prefill_pool_pages=4 * 6).with_options(
        compute=dict(prefill_tokens_per_s=64 / 0.01, prefill_chunk_tokens=16),
        link=dict(bandwidth_bytes_per_s=16 * 40960 / 0.25, writes_in_flight_max=1),
        timeouts=dict(lease_s=LEASE_S, transfer_timeout_s=1.5))
    sim, times = _watched(sc)
    _burst(sim)
    assert sim.folder.metrics.summary()["outcomes"] == {"Ok": 6} and "Timeout" not in times
    waited_s = times["SendPage"][5][0] - times["Admit"][5][0]
    assert waited_s > 9 * LEASE_S and waited_s > 3 * 1.5
    _every_page_back(sim)


def test_a_crashed_prefill_s_requests_time_out_within_the_lease_and_every_page_comes_back():
    # A crash rate makes the core's model one with prefill crashes; the crash loop that
    # would draw them runs only in Simulation.run, so the one crash is the injected one.
    sc = _slow_prefill(requests=6, prefill_crash_rate_per_s=1.0, prefill_restart_s=0.1)
    sim, times = _watched(sc)
    crash_at_s = 1.3  # request 0 computed, request 1 mid-compute, the rest queued
    sim.later(crash_at_s, sim.crash, "prefill", 0)
    _burst(sim)
    assert sim.folder.metrics.summary()["outcomes"] == {"ErrPrefill": 6 - 1, "Ok": 1}
    timed_out = times["Timeout"]
    assert sorted(timed_out) == [1, 2, 3, 4, 5]
    # Each lease ran from the prefill's last sign of life: the last chunk done before the
    # crash (request 1's compute started at ~0.8 s and finished its second chunk 0.4 s on).
    last_chunk_s = times["Admit"][1][0] + 2 * CHUNK_S
    for r, (at,) in timed_out.items():
        assert at == pytest.approx(last_chunk_s + LEASE_S), r
        assert crash_at_s < at <= crash_at_s + LEASE_S
    assert all(r in times["Release"] for r in timed_out)  # cancel, final word, release
    assert sim.cluster.violation_counts == {}
    _every_page_back(sim)


def test_the_lease_is_validated():
    with pytest.raises(ScenarioError, match="timeouts.lease_s"):
        scenario_from_dict({"timeouts": {"lease_s": 0}})
    assert Scenario().timeouts.lease_s == 1.0


def test_a_backstop_already_past_at_reserve_fires_at_once():
    # Found by the sim fuzz target: with AdmitBeforeReserve the prefill admits before decode
    # reserves, and a backstop shorter than the bootstrap's trip (0.5 ms) has run out when
    # the timer is armed; SimPy refused the negative delay and the shell crashed.
    sc = _slow_prefill(requests=2).with_options(
        bugs=("AdmitBeforeReserve",), timeouts=dict(lease_s=LEASE_S, transfer_timeout_s=1e-4))
    sim, times = _watched(sc)
    _burst(sim)
    assert times["Timeout"][0] == times["Reserve"][0]  # admitted 0.5 ms before
    assert times["Timeout"][1][0] == pytest.approx(times["Admit"][1][0] + 1e-4)
    _every_page_back(sim)
