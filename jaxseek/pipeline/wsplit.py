"""Splitting a backward into b (what the previous stage waits for) and W (what nothing waits for), exactly.

Zero-bubble pipeline orders (pipeline/zero_bubble.py) run a chunk's backward in two parts: b computes the
cotangent of the chunk's input, W the gradients of its weights later, from what b stashed. `split` does this
on the traced backward itself, without touching the model: given the jaxpr of a function and which of its
outputs b must return, it assigns every equation to b (it is needed for those outputs) or to W (it is needed
for the others only), so that each equation runs once. The values W reads from b's side are b's residuals (its
stash): per matmul the layer input and the output cotangent, whatever the jaxpr says.

Equations that compute both kinds of outputs are split inside:

- `scan` (the layer loop, a loop inside a backward): the carries b needs run in a b loop that also emits, per
  iteration, the values the W loop reads; the other carries and outputs run in a W loop over those;
- `jit`, `checkpoint` (a call, remat): their inner jaxpr is split in place (inlined: nothing is
  differentiated again, so inlining changes no value);
- `shard_map` (the MoE dispatch): a b shard_map and a W shard_map over the same mesh axes; b's returns each
  inner residual as one block per device, W's takes it back (`_ShardMapSplit`).

Any other equation (a `cond`, a custom kernel) runs whole in b; a weight gradient it computes is returned by b
at once (`Split.b_outputs` lists it), not stashed: exact, but that part's weight gradients cost b's time.
Cheap layout ops on what W is given again (a weight's cast or transpose, `REDO`) are redone in W rather than
stashed, and a loop output that is one of its stacked inputs passed through (a layer's weights handed from the
forward scan to the backward) is read as that input.

    split = split(closed_jaxpr, b_outputs, w_args)  # b_outputs: one bool per output; w_args: weights' indices
    b_values, stash = split.b(*args)                # the outputs split.b_outputs names, and the residuals
    w_values = split.w(stash, *weights)             # those split.w_outputs names
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jaxseek.errors import UserError

# What the split reads from JAX: jax.extend's names, which JAX may change in any release (pyproject.toml bounds
# jax to the minor version tested; `missing` checks them at import).
TESTED_JAX = "0.10.2"
READS = {
    "jax.extend.core": ("Literal", "Jaxpr", "ClosedJaxpr", "JaxprEqn", "Primitive"),
    "jax.extend.source_info_util": ("current_name_stack", "user_context", "SourceInfo"),
    "JaxprEqn": ("invars", "outvars", "primitive", "params", "source_info", "ctx"),
    "Jaxpr": ("constvars", "invars", "outvars", "eqns"),
    "ClosedJaxpr": ("jaxpr", "consts"),
    "Primitive": ("name", "bind", "get_bind_params", "multiple_results"),
    "Literal": ("val",),
    "SourceInfo": ("traceback", "name_stack"),
}


def _has(owner, name: str) -> bool:
  """Whether a module or class has `name` (a class's slots and dataclass fields count)."""
  return hasattr(owner, name) or name in getattr(owner, "__slots__", ()) or name in getattr(
      owner, "__dataclass_fields__", {})


def missing(core=jcore, source_info=source_info_util) -> tuple[str, ...]:
  """What of READS the given JAX modules lack ("JaxprEqn.ctx", ...): empty on the JAX this module was tested on."""
  modules = {"jax.extend.core": core, "jax.extend.source_info_util": source_info}
  gone = [f"{where}.{name}" for where, mod in modules.items() for name in READS[where] if not _has(mod, name)]
  owners = {"SourceInfo": getattr(source_info, "SourceInfo", None),
            **{n: getattr(core, n, None) for n in READS["jax.extend.core"]}}
  if owners["Primitive"] is not None:
    owners["Primitive"] = owners["Primitive"]("probe")  # its name is set per instance
  for where, owner in owners.items():
    if owner is not None and where in READS:
      gone += [f"{where}.{name}" for name in READS[where] if not _has(owner, name)]
  return tuple(gone)


MISSING = missing()  # checked once, at import


def check(key: str, value: str) -> None:
  """Refuses config `key` = `value`, a schedule whose backward is split, when the installed JAX lacks what the
  split reads (MISSING)."""
  if MISSING:
    raise UserError(f"config key {key}: {value} needs the backward split, which reads JAX internals that jax "
                    f"{jax.__version__} changed ({', '.join(MISSING)}); install jax=={TESTED_JAX} (make install "
                    f"pins it) or use 1f1b")

# layout and dtype ops W redoes from what it reads anyway instead of stashing their outputs
REDO = ("convert_element_type", "transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy",
        "copy_p", "sharding_constraint", "slice", "pvary")
INLINE = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2")


def _literal(v) -> bool:
  return isinstance(v, jcore.Literal)


def _inner(eqn) -> tuple[jcore.Jaxpr, list]:
  """(open jaxpr, its consts) of a call-like equation."""
  j = eqn.params["jaxpr"]
  if isinstance(j, jcore.ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


@dataclasses.dataclass
class _Part:
  """One equation's share in a plan: "b" or "w" (run whole on that side), "split" (`sub`), or "none"."""

  def __init__(self, eqn, side: str, sub=None):
    self.eqn, self.side, self.sub = eqn, side, sub
    self.dup = False  # a b equation W redoes (True), or may (None)


def _b_parts(jaxpr: jcore.Jaxpr, want_b: Sequence[bool], w_free: set) -> list[_Part]:
  """Each equation's part in b, in order: run whole in b, split (what b's outputs need of it), or "none" (for
  `_w_parts` to assign)."""
  need_b = {v for v, b in zip(jaxpr.outvars, want_b) if b and not _literal(v)}
  parts: list[_Part] = []
  for eqn in reversed(jaxpr.eqns):  # b: what its outputs need
    used = [v in need_b for v in eqn.outvars]
    if not any(used):
      parts.append(_Part(eqn, "none"))
      continue
    sub = _sub_plan(eqn, used, w_free) if not all(used) else None
    if sub is not None:
      parts.append(_Part(eqn, "split", sub))
      need_b |= {v for v in sub.b_inputs() if not _literal(v)}
    else:
      parts.append(_Part(eqn, "b"))
      need_b |= {v for v in eqn.invars if not _literal(v)}
  parts.reverse()
  return parts


def _w_parts(parts: list[_Part], outs: list, want_b: Sequence[bool], w_free: set) -> set:
  """Assigns W its equations in `parts` (those W's outputs need that b did not compute; b's cheap layout ops W
  redoes, `_Part.dup`; W's share of split equations); returns the vars W needs."""
  # b's cheap layout ops on what W reads anyway (a weight's cast or transpose): W redoes them rather than
  # stash their outputs
  avail = set(w_free)
  for part in parts:
    if part.side == "b" and part.eqn.primitive.name in REDO and all(
        _literal(v) or v in avail for v in part.eqn.invars):
      avail |= set(part.eqn.outvars)
      part.dup = None  # a candidate
  need_w = {v for v, b in zip(outs, want_b) if b is False and not _literal(v)}
  for part in reversed(parts):  # W: what its outputs need that b did not compute
    if part.side == "b":
      if part.dup is None and any(v in need_w for v in part.eqn.outvars):
        part.dup = True
        need_w |= {v for v in part.eqn.invars if not _literal(v)}
      continue
    if part.side == "split":
      w_outs = [v in need_w for v in part.eqn.outvars]
      part.sub.restrict_w(w_outs)
      if any(part.sub.want_w):
        need_w |= {v for v in part.sub.w_inputs() if not _literal(v)}
      continue
    if any(v in need_w for v in part.eqn.outvars):
      part.side = "w"
      need_w |= {v for v in part.eqn.invars if not _literal(v)}
  return need_w


class _Plan:
  """The split of one jaxpr: which equations run in b, in W, or split, and the vars W reads from b."""

  def __init__(self, jaxpr: jcore.Jaxpr, want_b: Sequence[bool], w_free: set, b_missing: set = frozenset()):
    """want_b: per outvar, whether b returns it (True), W (False) or nobody (None); w_free: vars W may read
    without b (invars W is given again, constvars); b_missing: invars b is not given (a loop's carries that only W
    runs)."""
    self.jaxpr = jaxpr
    outs = list(jaxpr.outvars)
    # a loop's output that is one of its inputs passed through (the forward scan of a vjp hands each layer's
    # weights to the backward so): W reads the input it is, when W is given that
    self.aliases = {o: a for o, a in _passed_through(jaxpr).items() if a in w_free}
    w_free = set(w_free) | set(self.aliases)
    parts = _b_parts(jaxpr, want_b, w_free)
    have_b = (set(jaxpr.invars) - set(b_missing)) | set(jaxpr.constvars)
    for part in parts:
      if part.side == "b":
        have_b |= set(part.eqn.outvars)
      elif part.side == "split":
        have_b |= {v for v, u in zip(part.eqn.outvars, part.sub.want) if u}
    need_w = _w_parts(parts, outs, want_b, w_free)
    self.parts = parts
    self.want_b = list(want_b)
    produced_w = {v for p in parts if p.side == "w" or p.dup for v in p.eqn.outvars}
    produced_w |= {v for p in parts if p.side == "split" for v, u in zip(p.eqn.outvars, p.sub.want_w) if u}
    # what W reads that b computed (or b's inputs W is not given again): the residuals, in a fixed order
    # outputs for W that b computes anyway (a weight gradient inside an equation run whole in b): b returns
    # them at once rather than stash them
    self.early = [i for i, (v, b) in enumerate(zip(outs, want_b))
                  if b is False and (_literal(v) or (v in have_b and v not in produced_w))]
    # (an early output W's own equations read too stays a residual)
    read_w = {v for p in parts if p.side == "w" or p.dup for v in p.eqn.invars if not _literal(v)}
    read_w |= {v for p in parts if p.side == "split" and any(p.sub.want_w) for v in p.sub.w_inputs()}
    need_w -= {outs[i] for i in self.early} - read_w
    residuals = [v for v in _ordered(need_w, jaxpr)
                 if v not in produced_w and v in have_b and v not in w_free and v not in self.aliases]
    # a value computed more than once (the forward reshapes a layer's normed input once per projection) is
    # stashed once; W reads the others as that one
    value = _values(jaxpr)
    first = {}
    self.same = {v: first.setdefault(value.get(v, v), v) for v in residuals}
    self.same = {v: k for v, k in self.same.items() if v is not k}
    self.residuals = [v for v in residuals if v not in self.same]
    self.w_outs = [i for i, b in enumerate(want_b) if b is False and i not in self.early]

  def b_inputs(self) -> list:
    """The vars of this jaxpr's scope that b reads (its invars and constvars among them)."""
    out = [v for p in self.parts if p.side == "b" for v in p.eqn.invars]
    out += [v for p in self.parts if p.side == "split" for v in p.sub.b_inputs()]
    returned = [v for v, r in zip(self.jaxpr.outvars, self.b_returns) if r and not _literal(v)]
    return [v for v in out if not _literal(v)] + returned

  @property
  def b_returns(self) -> list[bool]:
    """Per output, whether b returns it (those asked for, and the early ones)."""
    early = set(self.early)
    return [bool(b) or i in early for i, b in enumerate(self.want_b)]

  def w_reads(self) -> set:
    read = {v for p in self.parts if p.side == "w" or p.dup for v in p.eqn.invars if not _literal(v)}
    read |= {v for p in self.parts if p.side == "split" and any(p.sub.want_w) for v in p.sub.w_inputs()}
    return read | {v for i in self.w_outs for v in [self.jaxpr.outvars[i]] if not _literal(v)}

  def stash_varying(self) -> list:
    """Per leaf of `run_b`'s stash (the same nesting), the manual mesh axes it varies over."""
    return [[_varying(v) for v in self.residuals],
            [p.sub.stash_varying() for p in self.parts if p.side == "split"]]

  def run_b(self, env: dict) -> list:
    """Runs b's equations in `env` (vars → values); returns the residuals: this scope's, then each split
    equation's (a list each)."""
    nested = []
    for part in self.parts:
      if part.side == "b":
        _eval(part.eqn, env)
      elif part.side == "split":
        nested.append(part.sub.run_b(env))
    return [[env[v] for v in self.residuals], nested]

  def run_w(self, env: dict, stash: list) -> None:
    own, nested = stash
    env.update(zip(self.residuals, own))
    env.update((v, env[k]) for v, k in self.same.items())
    env.update((o, env[a]) for o, a in self.aliases.items() if a in env)
    it = iter(nested)
    for part in self.parts:
      if part.side == "w" or part.dup:
        _eval(part.eqn, env)
      elif part.side == "split":
        sub_stash = next(it)
        if any(part.sub.want_w):
          part.sub.run_w(env, sub_stash)


def _passed_through(jaxpr: jcore.Jaxpr) -> dict:
  """Outputs of the jaxpr's scans that are one of their stacked inputs unchanged → that input."""
  out = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "scan":
      continue
    body, nc, nk = eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], eqn.params["num_carry"]
    xs_in = {v: o for v, o in zip(body.invars[nc + nk:], eqn.invars[nc + nk:])}
    for v, o in zip(body.outvars[nk:], eqn.outvars[nk:]):
      if not _literal(v) and v in xs_in and not _literal(xs_in[v]):
        out[o] = xs_in[v]
  return out


def _values(jaxpr: jcore.Jaxpr) -> dict:
  """A key per equation output of the jaxpr, equal for two outputs that are the same value: the same primitive
  with the same parameters on the same values (value numbering; for a scan, two stacked outputs its body computes
  alike). Equations with effects or a jaxpr among their parameters (other than a scan) get keys of their own."""
  key: dict = {}
  atom = lambda v: ("literal", repr(v.val), str(v.aval)) if _literal(v) else key.get(v, ("var", id(v)))
  for eqn in jaxpr.eqns:
    name, params = eqn.primitive.name, eqn.params
    if eqn.effects:
      continue
    if name == "scan":
      body = params["jaxpr"].jaxpr
      inner = _values(body)
      n = params["num_carry"]
      ins = tuple(atom(v) for v in eqn.invars)
      at = {v: ("in", k) for k, v in enumerate(body.invars)}  # a body invar counts by its position
      for o, b in zip(eqn.outvars[n:], body.outvars[n:]):  # stacked outputs the body computes alike
        own = at.get(b) if not _literal(b) else ("literal", repr(b.val))
        key[o] = ("scan", ins, repr({k: v for k, v in params.items() if k != "jaxpr"}),
                  own if own is not None else inner.get(b, ("var", id(b))), str(o.aval))
      continue
    if any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in params.values()):
      continue
    try:
      p = repr(sorted(params.items()))
    except Exception:  # noqa: BLE001 (parameters without a stable repr: no key)
      continue
    ins = tuple(atom(v) for v in eqn.invars)
    for i, o in enumerate(eqn.outvars):
      key[o] = (name, p, ins, i)
  return key


def _ordered(vars_: set, jaxpr: jcore.Jaxpr) -> list:
  """`vars_` in the order the jaxpr defines them (constvars, invars, then equation outputs)."""
  order = list(jaxpr.constvars) + list(jaxpr.invars) + [v for e in jaxpr.eqns for v in e.outvars]
  seen, out = set(), []
  for v in order:
    if v in vars_ and v not in seen:
      seen.add(v)
      out.append(v)
  return out


def _read(env: dict, v):
  return v.val if _literal(v) else env[v]


def _eval(eqn, env: dict) -> None:
  """One equation, as jax.core.eval_jaxpr runs it (its name stack and context kept)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  names = source_info_util.current_name_stack() + eqn.source_info.name_stack
  with source_info_util.user_context(eqn.source_info.traceback, name_stack=names), eqn.ctx.manager:
    out = eqn.primitive.bind(*[_read(env, v) for v in eqn.invars], **params)
  outs = out if eqn.primitive.multiple_results else [out]
  for v, x in zip(eqn.outvars, outs):
    env[v] = x


def _sub_plan(eqn, used: list[bool], w_free: set):
  name = eqn.primitive.name
  if name in INLINE and "jaxpr" in eqn.params:
    return _CallSplit(eqn, used, w_free)
  if name == "scan":
    return _ScanSplit(eqn, used)
  if name == "shard_map" and _plain_manual(eqn):
    return _ShardMapSplit(eqn, used, w_free)
  return None


def _varying(v) -> frozenset:
  """The manual mesh axes a value varies over (empty outside a shard_map or without its varying-axes check)."""
  mat = getattr(v.aval, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def _plain_manual(eqn) -> bool:
  """A shard_map whose values carry no unreduced or reduced types (what its split can hand across)."""
  j, _ = _inner(eqn)
  for v in list(j.invars) + [v for e in j.eqns for v in e.outvars]:
    mat = getattr(v.aval, "manual_axis_type", None)
    if mat is not None and (mat.unreduced or mat.reduced):
      return False
  return {"mesh", "in_specs", "out_specs", "check_vma"} <= set(eqn.params)


class _CallSplit:
  """A call-like equation (jit, checkpoint) split in place: its inner jaxpr's plan, run inlined."""

  def __init__(self, eqn, used: list[bool], w_free: set):
    self.eqn = eqn
    self.inner, self.consts = _inner(eqn)
    self.want = list(used)
    self.want_w = [not u for u in used]
    # W is given every operand it reads (the enclosing plan stashes those b computed, once, at its level)
    self.plan = _Plan(self.inner, used, set(self.inner.constvars) | set(self.inner.invars))
    self.want = self.plan.b_returns
    self.want_w = [not u for u in self.want]

  def _outer(self, inner_vars) -> list:
    return [o for i, o in zip(self.inner.invars, self.eqn.invars) if i in inner_vars]

  def b_inputs(self):
    return self._outer(set(self.plan.b_inputs()))

  def restrict_w(self, w_outs):
    self.want_w = [w and not u for w, u in zip(w_outs, self.want)]
    # planned again for the outputs W is asked for, so that nothing is stashed for an output no one reads (b's
    # part, and what it returns, stay as they were)
    self.plan = _Plan(self.inner, [True if u else (False if w else None) for u, w in zip(self.want, self.want_w)],
                      set(self.inner.constvars) | set(self.inner.invars))

  def w_inputs(self):
    return self._outer(self.plan.w_reads())

  def _env(self, env):
    e = dict(zip(self.inner.constvars, self.consts))
    for i, o in zip(self.inner.invars, self.eqn.invars):
      if _literal(o) or o in env:
        e[i] = _read(env, o)
    return e

  def stash_varying(self):
    return self.plan.stash_varying()

  def run_b(self, env):
    e = self._env(env)
    stash = self.plan.run_b(e)
    for o, i, u in zip(self.eqn.outvars, self.inner.outvars, self.want):
      if u:
        env[o] = _read(e, i)
    return stash

  def run_w(self, env, stash):
    e = self._env(env)
    self.plan.run_w(e, stash)
    for o, i, u in zip(self.eqn.outvars, self.inner.outvars, self.want_w):
      if u:
        env[o] = _read(e, i)


class _ScanSplit:
  """A scan split into a b loop and a W loop (module docstring)."""

  def __init__(self, eqn, used):
    p = eqn.params
    self.eqn = eqn
    closed = p["jaxpr"]
    self.body, self.body_consts = closed.jaxpr, list(closed.consts)
    nc, nk = p["num_consts"], p["num_carry"]
    self.nc, self.nk = nc, nk
    body_in = self.body.invars
    self.consts_in, self.carry_in, self.xs_in = body_in[:nc], body_in[nc:nc + nk], body_in[nc + nk:]
    # carries b runs: those whose outputs b needs, and those b's part of the body reads (to a fixpoint)
    carry_b = list(used[:nk])
    while True:
      want = carry_b + list(used[nk:])
      plan = _Plan(self.body, want, set(self.consts_in) | set(self.xs_in) | set(self.body.constvars),
                   {v for c, v in zip(carry_b, self.carry_in) if not c})
      read = set(plan.b_inputs())
      grown = [c or (v in read) for c, v in zip(carry_b, self.carry_in)]
      if grown == carry_b:
        break
      carry_b = grown
    want = [w or (k >= nk and r) for k, (w, r) in enumerate(zip(want, plan.b_returns))]  # early ys in b
    self.carry_b, self.body_want, self.plan = carry_b, want, plan
    self.want = want
    self.want_w = [not u for u in want]
    # per iteration, what the W loop reads from the b loop (consts and xs it reads itself)
    self.stacked = list(plan.residuals)

  def stash_varying(self):
    return self.plan.stash_varying()  # stacked over the iterations: the same axes

  def b_inputs(self):
    read = set(self.plan.b_inputs())
    ins, nc, nk = self.eqn.invars, self.nc, self.nk
    out = [o for i, o in zip(self.consts_in, ins[:nc]) if i in read]
    out += [o for k, o in enumerate(ins[nc:nc + nk]) if self.carry_b[k]]
    return out + [o for i, o in zip(self.xs_in, ins[nc + nk:]) if i in read]

  def restrict_w(self, w_outs):
    self.want_w = [w and not b for w, b in zip(w_outs, self.want)]

  def w_inputs(self):
    read = self.plan.w_reads()
    ins, nc, nk = self.eqn.invars, self.nc, self.nk
    out = [o for i, o in zip(self.consts_in, ins[:nc]) if i in read]
    out += [o for k, o in enumerate(ins[nc:nc + nk]) if not self.carry_b[k]]
    return out + [o for i, o in zip(self.xs_in, ins[nc + nk:]) if i in read]

  def _scope(self, consts, xs_i):
    e = dict(zip(self.body.constvars, self.body_consts))
    e.update((i, c) for i, c in zip(self.consts_in, consts) if c is not None)
    e.update((i, x) for i, x in zip(self.xs_in, xs_i) if x is not None)
    return e

  def run_b(self, env):
    p, ins, nc, nk = self.eqn.params, self.eqn.invars, self.nc, self.nk
    read = set(self.plan.b_inputs())
    consts = [_read(env, v) if i in read else None for i, v in zip(self.consts_in, ins[:nc])]
    carry = [_read(env, v) for k, v in enumerate(ins[nc:nc + nk]) if self.carry_b[k]]
    xs = [_read(env, v) if i in read else None for i, v in zip(self.xs_in, ins[nc + nk:])]
    body, plan, kb = self.body, self.plan, sum(self.carry_b)

    def step(carry, xs_i):
      e = self._scope(consts, xs_i)
      e.update(zip([v for k, v in enumerate(self.carry_in) if self.carry_b[k]], carry))
      stash = plan.run_b(e)
      outs = [_read(e, v) for v, w in zip(body.outvars, self.body_want) if w]
      return outs[:kb], (outs[kb:], stash)

    carry, (ys, stash) = jax.lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"],
                                      unroll=p["unroll"])
    outs = iter(list(carry) + list(ys))
    for v, w in zip(self.eqn.outvars, self.want):
      if w:
        env[v] = next(outs)
    return stash

  def run_w(self, env, stash):
    p, ins, nc, nk = self.eqn.params, self.eqn.invars, self.nc, self.nk
    read = self.plan.w_reads()
    consts = [_read(env, v) if i in read else None for i, v in zip(self.consts_in, ins[:nc])]
    carry_w = [k for k in range(nk) if not self.carry_b[k]]
    carry = [_read(env, ins[nc + k]) for k in carry_w]
    xs = [_read(env, v) if i in read else None for i, v in zip(self.xs_in, ins[nc + nk:])]
    body, plan = self.body, self.plan
    w_ys = [k for k in range(nk, len(self.eqn.outvars)) if self.want_w[k]]

    def step(carry, inputs):
      xs_i, stash_i = inputs
      e = self._scope(consts, xs_i)
      e.update(zip([self.carry_in[k] for k in carry_w], carry))
      plan.run_w(e, stash_i)
      return [_read(e, body.outvars[k]) for k in carry_w], [_read(e, body.outvars[k]) for k in w_ys]

    carry, ys = jax.lax.scan(step, carry, (xs, stash), length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    for k, c in zip(carry_w, carry):
      if self.want_w[k]:
        env[self.eqn.outvars[k]] = c
    for k, y in zip(w_ys, ys):
      env[self.eqn.outvars[k]] = y


class _ShardMapSplit(_CallSplit):
  """A shard_map split into a b shard_map and a W shard_map over the same mesh axes: b returns, beside its
  outputs, each residual of the inner plan as one block per device (a leading axis of 1, laid over the manual
  axes it varies over, so a value the devices share is kept once), which W's shard_map takes back with the same
  spec. The routed experts' weight gradients (their grouped matmuls, inside the dispatch's shard_map) run in W so."""

  def __init__(self, eqn, used: list[bool], w_free: set):
    super().__init__(eqn, used, w_free)
    p = eqn.params
    self.mesh, self.check = p["mesh"], p["check_vma"]
    self.manual = frozenset(p.get("newly_manual_axes") or p.get("axis_names") or p["mesh"].axis_names)

  def _stash(self):
    """(the inner stash's tree, each leaf's spec on its leading per-device axis, the axes it varies over
    outside); with the varying-axes check a spec names exactly the manual axes the leaf varies over, without
    it every device keeps its own block."""
    leaves, tree = jax.tree.flatten(self.plan.stash_varying(), is_leaf=lambda x: isinstance(x, frozenset))
    axes = [(v & self.manual) if self.check else self.manual for v in leaves]
    specs = [jax.sharding.PartitionSpec(tuple(a for a in self.mesh.axis_names if a in ax) or None) for ax in axes]
    return tree, specs, [v - self.manual for v in leaves]

  def stash_varying(self):
    return self._stash()[2]

  def _map(self, fn, in_specs, out_specs):
    return jax.shard_map(fn, mesh=self.mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs),
                         axis_names=set(self.manual), check_vma=self.check)

  def run_b(self, env):
    p, inner = self.eqn.params, self.inner
    read = set(self.plan.b_inputs())
    idx = [k for k, i in enumerate(inner.invars) if i in read and not _literal(self.eqn.invars[k])]
    outs = [k for k, u in enumerate(self.want) if u]

    def body(*args):
      e = self._env({})
      e.update((inner.invars[k], a) for k, a in zip(idx, args))
      stash = jax.tree.leaves(self.plan.run_b(e))
      return [_read(e, inner.outvars[k]) for k in outs], [x[None] for x in stash]

    got, stash = self._map(body, [p["in_specs"][k] for k in idx],
                           ([p["out_specs"][k] for k in outs], self._stash()[1]))(
        *[_read(env, self.eqn.invars[k]) for k in idx])
    for k, v in zip(outs, got):
      env[self.eqn.outvars[k]] = v
    return stash

  def run_w(self, env, stash):
    p, inner = self.eqn.params, self.inner
    read = self.plan.w_reads()
    idx = [k for k, i in enumerate(inner.invars) if i in read and not _literal(self.eqn.invars[k])]
    outs = [k for k, u in enumerate(self.want_w) if u]
    if not outs:
      return

    def body(leaves, *args):
      e = self._env({})
      e.update((inner.invars[k], a) for k, a in zip(idx, args))
      self.plan.run_w(e, jax.tree.unflatten(tree, [x[0] for x in leaves]))
      return tuple(_read(e, inner.outvars[k]) for k in outs)

    tree, specs, _ = self._stash()
    got = self._map(body, [specs] + [p["in_specs"][k] for k in idx], [p["out_specs"][k] for k in outs])(
        list(stash), *[_read(env, self.eqn.invars[k]) for k in idx])
    for k, v in zip(outs, got):
      env[self.eqn.outvars[k]] = v


@dataclasses.dataclass
class Split:
  """b and W of a closed jaxpr (module docstring)."""

  closed: jcore.ClosedJaxpr
  plan: _Plan
  w_args: tuple[int, ...]  # the arguments W is given again

  @property
  def b_outputs(self) -> list[int]:
    """The outputs b returns: those asked for and the early ones (`_Plan.early`), in order."""
    return [i for i, r in enumerate(self.plan.b_returns) if r]

  @property
  def w_outputs(self) -> list[int]:
    return list(self.plan.w_outs)

  def b(self, *args) -> tuple[list, list]:
    """(the outputs `b_outputs` names, the stash W reads)."""
    j = self.closed.jaxpr
    env = dict(zip(j.constvars, self.closed.consts))
    env.update(zip(j.invars, args))
    stash = self.plan.run_b(env)
    return [_read(env, j.outvars[i]) for i in self.b_outputs], stash

  def w(self, stash, *w_args) -> list:
    """The outputs `w_outputs` names, from the stash and the arguments `w_args` names."""
    j = self.closed.jaxpr
    env = dict(zip(j.constvars, self.closed.consts))
    env.update(zip([j.invars[i] for i in self.w_args], w_args))
    self.plan.run_w(env, stash)
    return [_read(env, j.outvars[i]) for i in self.plan.w_outs]


def split(closed: jcore.ClosedJaxpr, b_outputs: Sequence[bool], w_args: Sequence[int] = ()) -> Split:
  """The plan of b and W for `closed` (module docstring); `w_args`: indices of the arguments W is given again
  (the weights), so that they are not stashed."""
  j = closed.jaxpr
  plan = _Plan(j, b_outputs, set(j.constvars) | {j.invars[i] for i in w_args})
  return Split(closed, plan, tuple(w_args))
