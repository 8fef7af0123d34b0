"""Outage decisions: properties over every failure, clock and interleaving of requests."""

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from asyncgrpo.core.servers.outage import (
    UNREACHABLE_STATUSES,
    Failure,
    OutageClock,
    ServerTrust,
    after_silent_probe,
    classify_failure,
    identity_seen,
    next_wait,
    outage_seen,
    push_landed,
    request_trusted,
    weights_known,
    weights_pushed,
)

statuses = st.one_of(st.none(), st.integers(500, 599))


@given(st.booleans(), st.booleans(), st.booleans(), statuses)
def test_an_unreachable_server_is_an_outage_and_a_slow_one_is_not(
    connect_failed, dropped, timed_out, status
) -> None:
    failure = classify_failure(
        connect_failed=connect_failed, dropped=dropped, timed_out=timed_out, status=status
    )
    gone = connect_failed or dropped or status in UNREACHABLE_STATUSES
    assert (failure is Failure.UNREACHABLE) == gone
    if not gone:
        assert failure is (Failure.TIMEOUT if timed_out else Failure.SERVER_ERROR)


@given(
    st.floats(0, 1e6),
    st.floats(0.1, 1e4),
    st.lists(st.floats(0, 100), min_size=1, max_size=60),
)
def test_a_wait_gives_up_exactly_at_the_timeout_and_never_sleeps_past_it(
    start, timeout, gaps
) -> None:
    clock, now, logged = OutageClock(down_since=start), start, 0
    for gap in gaps:
        decision = next_wait(clock, now, timeout)
        waited = now - start
        assert decision.give_up == (waited >= timeout)
        if decision.give_up:
            return
        assert 0 <= decision.sleep_s <= 5.0 and waited + decision.sleep_s <= timeout + 1e-9
        logged += decision.log
        assert logged >= 1  # the first probe is always logged
        clock = decision.clock
        now += decision.sleep_s + gap


@given(st.floats(0, 1e3), st.floats(1, 1e3), st.integers(1, 200))
def test_a_long_wait_is_logged_at_most_every_log_interval(start, every, probes) -> None:
    clock, now, logs = OutageClock(down_since=start), start, []
    for _ in range(probes):
        decision = next_wait(clock, now, timeout_s=1e9, log_every_s=every)
        if decision.log:
            logs.append(now)
        clock, now = decision.clock, now + decision.sleep_s + 0.01
    assert all(b - a >= every for a, b in itertools.pairwise(logs))


events = st.lists(
    st.one_of(
        st.tuples(st.just("start")),
        st.tuples(st.just("fail"), st.integers(0, 20)),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("push")),
        st.tuples(st.just("restart")),
    ),
    max_size=80,
)


@given(events)
def test_nothing_generated_across_an_outage_is_trusted(script) -> None:
    """Requests start, fail or finish in any order, the server restarts (a restart is only
    ever seen through a failure of a request in flight or a probe), the trainer pushes: a
    finished request is trusted only when it ran entirely under the trainer's weights."""
    trust = ServerTrust()
    in_flight: list[tuple[int, bool]] = []  # (outages seen at start, served by a fresh server)
    server_has_trainer_weights = True
    for event in script:
        if event[0] == "start":
            if weights_known(trust):  # else the request waits for the push
                in_flight.append((trust.outages, not server_has_trainer_weights))
        elif event[0] == "restart":
            server_has_trainer_weights = False
            # every request in flight fails: the first one seen counts the outage
            for _ in in_flight:
                trust = outage_seen(trust)
            if not in_flight:
                trust = outage_seen(trust)  # the probe / poller sees it
            in_flight = []
        elif event[0] == "push":
            covering = trust.outages
            trust = weights_pushed(trust, covering)
            server_has_trainer_weights = True
        elif in_flight:
            started, foreign = in_flight.pop(event[1] % len(in_flight))
            if event[0] == "fail":
                trust = outage_seen(trust)
            elif request_trusted(trust, started):
                assert not foreign and server_has_trainer_weights
        assert 0 <= trust.trusted <= trust.outages


@given(st.integers(0, 50), st.integers(0, 50), st.integers(0, 60))
def test_one_outage_counts_once_however_many_requests_fail(outages, failing, covering) -> None:
    trust = ServerTrust(outages=outages, trusted=outages)
    for _ in range(failing):
        trust = outage_seen(trust)
    assert trust.outages == outages + (1 if failing else 0)
    pushed = weights_pushed(trust, covering)
    assert pushed.trusted <= pushed.outages
    assert weights_known(pushed) == (max(trust.trusted, covering) >= trust.outages)


silent_events = st.lists(
    st.one_of(
        st.tuples(st.just("start")),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("push")),
        st.tuples(st.just("restart")),
        st.tuples(st.just("poll")),
    ),
    max_size=80,
)


@given(silent_events)
def test_a_restart_no_request_saw_is_caught_by_the_identity(script) -> None:
    """The server restarts in any order with requests, polls and pushes; a restart with no
    request in flight fails nothing, so only its new identity can tell. A finished request is
    trusted (after the probe that follows it) only when the server that sampled it held the
    trainer's weights, and one started right after a push is trusted."""
    boots = itertools.count(1)
    identity = float(next(boots))
    trust = weights_pushed(ServerTrust(), 0, identity)
    in_flight: list[tuple[int, bool]] = []  # (outages seen at start, sampled by foreign weights)
    server_has_trainer_weights = True
    for event in script:
        if event[0] == "start":
            if weights_known(trust):
                in_flight.append((trust.outages, not server_has_trainer_weights))
        elif event[0] == "restart":
            identity, server_has_trainer_weights = float(next(boots)), False
            for _ in in_flight:  # requests in flight fail; with none in flight nothing does
                trust = outage_seen(trust)
            in_flight = []
        elif event[0] == "poll":
            trust = identity_seen(trust, identity)
        elif event[0] == "push":  # the trainer probes first, then pushes what it covers
            trust = identity_seen(trust, identity)
            covering = trust.outages
            server_has_trainer_weights = True
            assert push_landed(identity, identity)
            trust = weights_pushed(trust, covering, identity)
            assert weights_known(trust)
            started = trust.outages  # a request right after the push is trusted
            assert request_trusted(identity_seen(trust, identity), started)
        elif in_flight:
            started, foreign = in_flight.pop(event[1] % len(in_flight))
            trust = identity_seen(trust, identity)  # the probe after it finished
            if request_trusted(trust, started):
                assert not foreign and server_has_trainer_weights
        assert 0 <= trust.trusted <= trust.outages


@given(st.integers(0, 9), st.integers(0, 9), st.one_of(st.none(), st.floats(0, 1e10)))
def test_an_unknown_identity_says_nothing(outages, trusted, seen) -> None:
    trust = ServerTrust(outages=max(outages, trusted), trusted=trusted)
    assert identity_seen(trust, seen) == trust  # nothing pushed-to known yet
    known = weights_pushed(trust, trust.outages, 5.0)
    assert identity_seen(known, None) == known
    assert identity_seen(known, 5.0) == known
    assert weights_pushed(known, known.outages).identity == 5.0  # kept when not given


@given(st.one_of(st.none(), st.floats(0, 1e10)), st.one_of(st.none(), st.floats(0, 1e10)))
def test_a_push_landed_only_when_one_server_took_it(before, after) -> None:
    assert push_landed(before, after) == (before == after)


@given(st.lists(st.one_of(st.none(), st.floats(0, 1e6)), min_size=1, max_size=6))
def test_a_pool_is_gone_only_when_every_server_is_and_since_the_last_went(down) -> None:
    from asyncgrpo.core.servers.outage import all_gone_since

    since = all_gone_since(down)
    if any(d is None for d in down):
        assert since is None
    else:
        assert since == max(down)


def simulated_silence_logs(
    durations: list[float], every_s: float, probe_s: float, deadline: float
) -> list[float]:
    """The times a silence watchdog logs when its probes take ``durations`` in turn (each in
    ``[0, probe_s]``: 0 is a probe reused from another call's) against a silent server."""
    logs: list[float] = []
    logged_at, now = -float("inf"), durations[0]
    for duration in itertools.chain(durations[1:], itertools.repeat(probe_s)):
        if now >= deadline:
            return logs
        step = after_silent_probe(now, logged_at, every_s, probe_s, deadline)
        if step.log_at is not None:
            assert step.log_at >= now and step.probe_at >= step.log_at
            logs.append(step.log_at)
            logged_at = step.log_at
        now = max(step.probe_at, now) + duration
    return logs


@example(durations=[5.0, 5.0, 0.0, 5.0, 5.0, 5.0], every_s=10.0, probe_s=5.0)  # the 14 s gap
@example(durations=[0.0, 0.0], every_s=18.0, probe_s=1.1)  # a probe's least gap ran past the due
@given(
    durations=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=40),
    every_s=st.floats(5.0, 30.0),
    probe_s=st.floats(0.5, 5.0),
)
def test_silence_logs_come_every_interval_whatever_the_probes_take(
    durations: list[float], every_s: float, probe_s: float
) -> None:
    """However long each probe takes (up to its timeout) or however early one ends (a reused
    probe), the silence is logged at the start and then every ``every_s``: never a log late by
    a probe's length (the 14 s gaps of a 10 s interval), never two within a second of the
    interval."""
    durations = [min(d, probe_s) for d in durations]
    deadline = durations[0] + 6 * every_s
    logs = simulated_silence_logs(durations, every_s, probe_s, deadline)
    assert logs and logs[0] == durations[0]
    gaps = [later - earlier for earlier, later in itertools.pairwise(logs)]
    assert all(every_s - 1.0 - 1e-9 <= gap <= every_s + 1e-9 for gap in gaps), gaps
    assert deadline - logs[-1] <= every_s + probe_s + 1e-9
