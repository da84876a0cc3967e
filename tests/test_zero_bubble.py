"""Zero-bubble orders (pipeline/zero_bubble.py): every op once and after what it reads, and their bubbles."""

import numpy as np
import pytest

from jaxseek.pipeline import zero_bubble as zb

ORDERS = {"zb_h1": zb.zb_h1, "zbv": zb.zbv, "dualpipev_zb": zb.dualpipev_zb}


def ticks_of(order):
  """(kind, microbatch, virtual stage) → tick, checked independently of the builder: one instruction per stage
  and tick, every f, b and w once."""
  where = {}
  for t, row in enumerate(order.ticks):
    assert len(row) == order.stages
    for s, ops in enumerate(row):
      for kind, r, m in ops:
        v = int(order.virtual[s, r])
        for k in ("b", "w") if kind == "B" else (kind,):
          assert (k, m, v) not in where
          where[k, m, v] = t
  V = order.virtual.size
  assert set(where) == {(k, m, v) for k in "fbw" for m in range(order.microbatches) for v in range(V)}
  return where


@pytest.mark.parametrize("packed", [False, True], ids=["unit", "packed"])
@pytest.mark.parametrize("name", sorted(ORDERS))
@pytest.mark.parametrize("S, M", [(2, 4), (4, 8), (4, 16), (3, 7), (4, 4), (4, 2), (8, 16)])
def test_every_op_runs_once_after_what_it_reads(name, S, M, packed):
  """A forward runs after the previous virtual stage's, a backward after the next one's (the last virtual stage
  after its own forward), a W after its b; in ticks strictly later (what is sent arrives the next tick). The
  V orders place stage s's chunks at virtual stages s and 2S − 1 − s. Packed orders put at most a forward and
  a W in one tick, never beside a b."""
  order = ORDERS[name](S, M, packed=packed)
  for row in order.ticks:
    for ops in row:
      kinds = sorted(k for k, _, _ in ops)
      assert kinds in ([], ["f"], ["b"], ["w"]) or (packed and kinds == ["f", "w"]), ops
  where = ticks_of(order)
  V = order.virtual.size
  for m in range(M):
    for v in range(V):
      assert where["f", m, v] < where["b", m, v] < where["w", m, v]
      if v:
        assert where["f", m, v - 1] < where["f", m, v]
      if v < V - 1:
        assert where["b", m, v + 1] < where["b", m, v]
  if name != "zb_h1":
    np.testing.assert_array_equal(order.virtual, np.stack([np.arange(S), 2 * S - 1 - np.arange(S)], 1))


def test_bubbles():
  """F = b = W = 1 per chunk: S = 4, M = 16: ZB-V ≤ 3.5%, ZB-H1 and DualPipeV ≤ 6.5%; S = 8, M = 16: ZB-V ≤ 7.5%.
  ZB-H1's is (S − 1)/(3M + S − 1), a third of 1F1B's fill and drain, from M = S on."""
  assert zb.zbv(4, 16).bubble() <= 0.035
  assert zb.zb_h1(4, 16).bubble() <= 0.065
  assert zb.dualpipev_zb(4, 16).bubble() <= 0.065
  assert zb.zbv(8, 16).bubble() <= 0.075
  for S, M in [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16), (3, 9)]:
    assert zb.zb_h1(S, M).bubble() == pytest.approx((S - 1) / (3 * M + S - 1))
  # DualPipeV with every op in a tick of its own reaches ZB-V's bubble at M ≥ 2S
  for S, M in [(4, 8), (4, 16), (8, 16)]:
    assert zb.dualpipev_zb(S, M).bubble() == pytest.approx((S - 1) / (6 * M + S - 1))


def test_packed_orders_fill_the_ticks_of_a_recomputing_backward():
  """jaxseek's b recomputes the chunk's forward (F = 1, b = 2, W = 1): one op a tick, a tick with a b somewhere
  costs 2 and the other stages idle half of it, so the unit orders' step is longer than 1F1B's (F = 1, B = 3 a
  full stage; chunks of the V cost half). Packing F and W into those ticks makes every order's step shorter
  than 1F1B's: at S = 4, M = 16 ZB-V's by 10%, with a bubble of at most 7% under these costs."""
  cost = zb.RECOMPUTE
  for S, M in [(4, 16), (8, 16), (4, 8)]:
    one_f_one_b = (M + S - 1) * 4  # ticks of F + B, a full stage
    for name, half in (("zb_h1", 1), ("zbv", 0.5), ("dualpipev_zb", 0.5)):
      unit, packed = ORDERS[name](S, M), ORDERS[name](S, M, packed=True)
      assert packed.span(cost) * half < one_f_one_b < unit.span(cost) * half * 1.01, (name, S, M)
      assert packed.work(cost) == unit.work(cost) == 4 * M * (1 if name == "zb_h1" else 2)
  assert zb.zbv(4, 16, packed=True).span(cost) / 2 <= 0.91 * 19 * 4
  assert zb.zbv(4, 16, packed=True).bubble(cost) <= 0.07


def test_what_a_stage_keeps():
  """ZB-H1 keeps 1F1B's stage inputs (at most S) and at most S stashes (stage s: s + 1); DualPipeV at most 2S + 1
  chunk inputs and S stashes; neither grows with M."""
  for S in (2, 4, 8):
    for M in (2 * S, 4 * S):
      assert zb.zb_h1(S, M).kept() == {"inputs": S, "stashes": S}
      assert zb.dualpipev_zb(S, M).kept() == {"inputs": 2 * S + 1, "stashes": S}
    assert zb.zbv(S, 2 * S).kept() == zb.zbv(S, 4 * S).kept()


def test_fusing_pairs_in_lock_step_costs_a_tick_of_two():
  """DualPipeV's F&B pairs fused into one tick cost 2 there while other stages run 1: the lock step makes the
  bubble larger than running each op in a tick of its own."""
  assert zb.dualpipev_zb(4, 16, fuse=True).bubble() > zb.dualpipev_zb(4, 16).bubble() + 0.1
  assert zb.dualpipev_zb(4, 16, fuse=True).bubble() < 0.25


def test_a_deadlocking_program_is_refused():
  """Stage 1 waiting for a backward stage 0 can only run after it: no tick can run anything."""
  virtual = np.array([[0], [1]])
  programs = [[(("f", 0, 0),), (("b", 0, 0),), (("w", 0, 0),)], [(("b", 0, 0),), (("f", 0, 0),), (("w", 0, 0),)]]
  with pytest.raises(AssertionError, match="deadlocks"):
    zb.run_programs(2, 1, virtual, programs)


@pytest.mark.parametrize("name, S, M, R, permutes", [("zbv", 4, 16, 2, 134), ("1f1b", 4, 16, 1, 36),
                                                     ("dualpipev", 4, 16, 2, 133), ("zb_h1", 4, 16, 1, 64)])
def test_each_route_is_one_collective_run_only_in_the_ticks_it_carries_something(name, S, M, R, permutes):
  """A tick's sends go one collective a route (Table.routes): on the V the activations and the cotangents share
  the pairs of each direction (s → s + 1, s → s − 1), so one ppermute carries both; 1F1B's go opposite ways.
  A route runs in every tick in which some stage receives by it and in no other. ZB-V at S = 4, M = 16 ran 300
  ppermutes a step, one per kind and offset in each of its 75 ticks: with the simulated CPU devices sharing the
  cores, each is a rendezvous of every device thread, and its step took 1.3-2x 1F1B's (44)."""
  from jaxseek.pipeline import tables

  table = tables.table(name, S, M, R)
  routes = [r for r in table.routes() if r.offset]
  for kind, by_offset in table.links.items():
    for d, pairs in by_offset.items():
      route, = [r for r in table.routes() if r.offset == d and r.pairs == pairs and kind in r.kinds]
      received = (table.steps[f"{kind}_in{d}"] >= 0).any(axis=1)
      assert not (received & ~route.active).any()  # nothing sent by it is left behind
  for route in routes:
    assert route.active.any() and (
        np.logical_or.reduce([(table.steps[f"{k}_in{route.offset}"] >= 0).any(axis=1) for k in route.kinds])
        == route.active).all()
  if name in ("zbv", "dualpipev"):
    assert sorted((r.offset, r.kinds) for r in routes) == [(1, ("f", "b")), (S - 1, ("f", "b"))]
  assert sum(int(r.active.sum()) for r in routes) == permutes
