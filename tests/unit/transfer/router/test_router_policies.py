"""Which engine the router picks: round robin, least load, cache-aware prefix affinity;
the pure policies on hand-made endpoints, then the same behaviour through the router's
HTTP path against stand-in engines (`pd_testbed.router_engines`; real vLLM is exercised by
the e2e tests). Needs neither NIXL, torch nor a GPU."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from pd_contract.transferagent import Role
from pd_testbed.router_engines import Answer, StandInEngine, call, sse
from pd_transfer.router import Endpoint, PolicyName, Router, RouterSettings
from pd_transfer.router.inflight import InFlight
from pd_transfer.router.policies import CacheAware, LeastLoad, RoundRobin, rendezvous_score
from pd_transfer.router.prompts import affinity_key

pytestmark = pytest.mark.timeout(30)


def _endpoints(role: Role, count: int) -> list[Endpoint]:
    return [Endpoint(role, f"10.0.{int(role is Role.DECODE)}.{i}", 8000, f"10.0.0.{i}:8998")
            for i in range(count)]


P3, D3 = _endpoints(Role.PREFILL, 3), _endpoints(Role.DECODE, 3)


def test_round_robin_takes_each_role_in_turn_independently() -> None:
    policy = RoundRobin()
    picks = [(policy.pick(Role.PREFILL, P3, None), policy.pick(Role.DECODE, D3[:2], "k"))
             for _ in range(4)]
    assert picks == [(P3[0], D3[0]), (P3[1], D3[1]), (P3[2], D3[0]), (P3[0], D3[1])]


def test_least_load_picks_the_idlest_and_takes_ties_in_turn() -> None:
    inflight = InFlight()
    policy = LeastLoad(inflight)
    inflight.begin(P3[0])
    inflight.begin(P3[0])
    inflight.begin(P3[1])
    assert [policy.pick(Role.PREFILL, P3, None) for _ in range(2)] == [P3[2], P3[2]]
    inflight.begin(P3[2])  # loads 2, 1, 1: the tie P3[1], P3[2] in turn
    assert [policy.pick(Role.PREFILL, P3, None) for _ in range(3)] == [P3[1], P3[2], P3[1]]


def test_cache_aware_keeps_a_prefix_on_one_engine_per_role_and_spreads_distinct_ones() -> None:
    policy = CacheAware(InFlight(), balance_threshold=16)
    shared = "You are a helpful assistant. " * 20  # 580 characters, longer than the prefix
    keys = [affinity_key({"prompt": shared + tail}, 256) for tail in ("a", "bb", "question?")]
    assert len(set(keys)) == 1
    assert len({policy.pick(Role.PREFILL, P3, k) for k in keys}) == 1
    assert len({policy.pick(Role.DECODE, D3, k) for k in keys}) == 1
    distinct = [affinity_key({"prompt": f"user {i} asks"}, 256) for i in range(60)]
    spread = Counter(policy.pick(Role.PREFILL, P3, k).name for k in distinct)
    # Rendezvous hashing is uniform: each of 3 engines gets about 20 of 60 keys.
    assert set(spread) == {e.name for e in P3} and min(spread.values()) >= 10


def test_cache_aware_moves_only_the_keys_of_an_engine_that_leaves() -> None:
    policy = CacheAware(InFlight(), balance_threshold=16)
    keys = [f"s:prompt {i}" for i in range(200)]
    before = {k: policy.pick(Role.DECODE, D3, k) for k in keys}
    after = {k: policy.pick(Role.DECODE, D3[:2], k) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == D3[2]}
    # The order is the rendezvous ranking: the winner has the highest score.
    key = keys[0]
    assert before[key] == max(D3, key=lambda e: rendezvous_score(key, e))


def test_cache_aware_passes_over_an_engine_loaded_beyond_the_threshold() -> None:
    inflight = InFlight()
    policy = CacheAware(inflight, balance_threshold=2)
    key = "s:hot prefix"
    ranked = sorted(P3, key=lambda e: rendezvous_score(key, e), reverse=True)
    for _ in range(2):  # 2 more than the idlest: still within the bound
        inflight.begin(ranked[0])
    assert policy.pick(Role.PREFILL, P3, key) == ranked[0]
    inflight.begin(ranked[0])  # 3 more: the next in the ranking
    assert policy.pick(Role.PREFILL, P3, key) == ranked[1]
    assert policy.pick(Role.PREFILL, P3, None) in ranked[1:]  # no key: an idlest one


@pytest.mark.parametrize(("body", "key"), [
    ({"prompt": "abcdef"}, "s:abcd"),
    ({"prompt": [5, 6, 7, 8, 9]}, "t:5,6,7,8"),
    ({"prompt": ["first prompt", "second"]}, "s:firs"),
    ({"prompt": [[1, 2], [3]]}, "t:1,2"),
    ({"messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "s:syst"),
    ({"prompt": ""}, None),
    ({"prompt": [True, 1]}, None),
    ({"input": "no prompt"}, None),
    ({"messages": "not a list"}, None),
])
def test_affinity_keys_of_each_prompt_shape(body: dict[str, object], key: str | None) -> None:
    assert affinity_key(body, 4) == key


# -- through the router ----------------------------------------------------------------------

class Fleet:
    """Two prefill and two decode stand-ins behind a router with ``policy``."""

    def __init__(self, policy: PolicyName) -> None:
        self.prefill = [StandInEngine(f"p{i}") for i in range(2)]
        self.decode = [StandInEngine(f"d{i}") for i in range(2)]
        self.router = Router(RouterSettings(
            host="127.0.0.1", port=0, policy=policy,
            prefill=tuple(e.spec(f"10.0.0.{i}:8998") for i, e in enumerate(self.prefill)),
            decode=tuple(e.spec(f"10.0.1.{i}:8998") for i, e in enumerate(self.decode))))

    def rotation(self, role: Role) -> list[str]:
        """The stand-ins' names in the router's order for ``role`` (sorted by address)."""
        names = {e.address: e.name for e in (*self.prefill, *self.decode)}
        return [names[e.name] for e in self.router.table.ready(role)]

    def served(self, engines: list[StandInEngine]) -> list[str]:
        """Which engine got each request, in arrival order."""
        arrivals = [(r.at, e.name) for e in engines for r in e.requests]
        return [name for _, name in sorted(arrivals)]

    def close(self) -> None:
        self.router.close(drain_s=5)
        for engine in (*self.prefill, *self.decode):
            engine.close()


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(request.param)
    try:
        yield f
    finally:
        f.close()


@pytest.mark.parametrize("fleet", [PolicyName.ROUND_ROBIN], indirect=True)
def test_round_robin_through_the_router(fleet: Fleet) -> None:
    for i in range(4):
        assert call(fleet.router.url, "POST", "/v1/completions", {"prompt": f"q{i}"})[0] == 200
    fleet.router.close(drain_s=5)
    assert fleet.served(fleet.prefill) == fleet.rotation(Role.PREFILL) * 2
    assert fleet.served(fleet.decode) == fleet.rotation(Role.DECODE) * 2


@pytest.mark.parametrize("fleet", [PolicyName.LEAST_LOAD], indirect=True)
def test_least_load_sends_the_next_request_to_the_idle_decode(fleet: Fleet) -> None:
    held = threading.Event()
    first_pick = fleet.rotation(Role.DECODE)[0]  # both idle: the tie goes to the first
    busy, idle = sorted(fleet.decode, key=lambda e: e.name != first_pick)
    busy.answer = lambda _: Answer(chunks=sse({"t": 1}), stream=True, between=held)
    first = threading.Thread(target=call, args=(fleet.router.url, "POST", "/v1/completions",
                                                {"prompt": "long", "stream": True}))
    first.start()
    try:
        assert busy.arrived.wait(10)
        for i in range(3):  # busy holds a stream: every new request goes to the idle one
            _settle(fleet.router, in_flight=1)
            assert call(fleet.router.url, "POST", "/v1/completions", {"prompt": f"{i}"})[0] \
                == 200
        assert (len(busy.requests), len(idle.requests)) == (1, 3)
        in_flight = fleet.router.inflight.snapshot()
        assert in_flight.get(fleet.router.table.ready(Role.DECODE)[0]) == 1
    finally:
        held.set()
        first.join(10)


def _settle(router: Router, in_flight: int) -> None:
    """Wait until the router counts ``in_flight`` requests. The client has its whole answer
    a moment before the router's handler thread leaves the request, and a pick in between
    would see the last answer's engine still loaded (a tie, not least load)."""
    deadline = time.monotonic() + 5
    while router.inflight.total() != in_flight:
        assert time.monotonic() < deadline, router.inflight.snapshot()
        time.sleep(0.005)


@pytest.mark.parametrize("fleet", [PolicyName.CACHE_AWARE], indirect=True)
def test_cache_aware_through_the_router_keeps_a_shared_prefix_together(fleet: Fleet) -> None:
    shared = [1000 + i for i in range(300)]  # token prompts sharing 300 ids (> 256)
    for tail in range(5):
        body = {"prompt": [*shared, tail], "max_tokens": 4}
        assert call(fleet.router.url, "POST", "/v1/completions", body)[0] == 200
    fleet.router.close(drain_s=5)
    assert len(set(fleet.served(fleet.prefill))) == 1
    assert len(set(fleet.served(fleet.decode))) == 1
