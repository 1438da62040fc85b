"""The scheme objects of :mod:`lragent.sharing` keep DESIGN.md §2's bookkeeping for asymmetric sessions.

Three agents with unequal appends take turns in a non-round-robin order (an agent acts twice in a row, another
comes back late, the trajectory is cut between turns); at every step the plan a scheme hands the engine must be
what an independent position-set model of the design table says: which positions the acting agent recomputes
(DroidSpeak's groups, ``base_shared``'s LR prefill), which it forwards at full depth, and, after the step, which
cache holds which prefix and how many bytes that is. The layouts (slots per role and row, pool sizes), DroidSpeak's
layer groups and the user-facing errors are pinned as well.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.schemes import SCHEMES, Scheme
from lragent.sharing import (
    BaseLRShared,
    BaseShared,
    DroidSpeak,
    Forward,
    FullShared,
    LRPrefill,
    NonShared,
    Recompute,
    SharingScheme,
    Trajectory,
    default_droidspeak_layers,
    groups_from_layers,
    make_scheme,
)
from lragent.static_cache import PoolLayout

N_ROLES = 3
PER_POSITION = {"k": 1000, "v": 100, "v_base": 10, "v_lr": 3, "hidden": 70000}


# ---- an independent model of the design table ---------------------------------------------------------------------
class Model:
    """What each scheme stores and computes, written as per-cache prefix lengths and per-role seen prefixes."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self.n = 0  # trajectory length
        self.kv = {}  # cache owner -> valid prefix
        self.lr = {}
        self.seen = {r: 0 for r in range(N_ROLES)}

    def owner(self, role: int) -> str:
        return f"own{role}" if self.scheme == "non_shared" else "shared"

    def step_plan(self, role: int) -> list[tuple[str, int, int]]:
        have = min(self.kv.get(self.owner(role), 0), self.n - 1)
        ops = []
        unseen_from = min(self.seen[role], have)
        if unseen_from < have and self.scheme == "droidspeak":
            ops.append(("recompute", unseen_from, have))
        if unseen_from < have and self.scheme == "base_shared":
            ops.append(("lr", unseen_from, have))
        ops.append(("forward", have, self.n))
        return ops

    def run(self, role: int, ops) -> None:
        for kind, _, end in ops:
            if kind == "forward":
                self.kv[self.owner(role)] = end
                if self.scheme == "base_shared":
                    self.lr[role] = end
                if self.scheme == "base_lr_shared":
                    self.lr["shared"] = end
            if kind == "lr":
                self.lr[role] = end

    def finish(self, role: int) -> None:
        self.seen[role] = min(self.n, self.kv.get(self.owner(role), 0))

    def cut(self, n: int) -> None:
        self.n = n
        self.kv = {k: min(v, n) for k, v in self.kv.items()}
        self.lr = {k: min(v, n) for k, v in self.lr.items()}
        self.seen = {k: min(v, n) for k, v in self.seen.items()}

    def bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        v = "v_base" if self.scheme in ("base_shared", "base_lr_shared") else "v"
        for length in self.kv.values():
            out["k"] = out.get("k", 0) + length * PER_POSITION["k"]
            out[v] = out.get(v, 0) + length * PER_POSITION[v]
        for length in self.lr.values():
            out["v_lr"] = out.get("v_lr", 0) + length * PER_POSITION["v_lr"]
        if self.scheme == "droidspeak" and "shared" in self.kv:
            out["hidden"] = self.kv["shared"] * PER_POSITION["hidden"]
        return out


def _as_tuples(ops) -> list[tuple[str, int, int]]:
    kinds = {Forward: "forward", Recompute: "recompute", LRPrefill: "lr"}
    return [(kinds[type(op)], op.start, op.end) for op in ops]


def run_session(scheme: str, turns) -> None:
    """Drives the scheme object and the model through ``turns`` (role, appended, generated, cut-to or None) and
    compares plans, lengths, ``seen`` and bytes after every step."""
    sch = make_scheme(scheme, N_ROLES, rows=1, n_layers=4, droidspeak_layers=[1, 2])
    traj, ref = Trajectory(), Model(scheme)
    token = 0
    for role, appended, generated, cut in turns:
        if cut is not None:
            sch.truncate(traj, cut)
            ref.cut(min(cut, ref.n))
            assert len(traj.ids) == ref.n
        traj.ids.extend(range(token, token + appended))
        token += appended
        ref.n += appended
        if not traj.ids:
            continue
        ops = sch.plan(traj, role)
        want = ref.step_plan(role)
        assert _as_tuples(ops) == want, (scheme, role, traj.lengths, traj.seen)
        for op in ops:
            sch.record(traj, role, op)
        ref.run(role, want)
        # generation: the engine keeps `generated` tokens and has written all but the last one as this role
        len0 = len(traj.ids)
        traj.ids.extend(range(token, token + generated))
        token += generated
        ref.n += generated
        if generated > 1:
            sch.record_forward(traj, role, len0, len0 + generated - 1)
            ref.run(role, [("forward", len0, len0 + generated - 1)])
        sch.finish_step(traj, role)
        ref.finish(role)
        assert traj.seen == {r: s for r, s in ref.seen.items() if r in traj.seen}, (scheme, traj.seen, ref.seen)
        assert all(ref.seen[r] == 0 for r in ref.seen if r not in traj.seen)
        assert sch.component_bytes(traj, PER_POSITION) == ref.bytes(), (scheme, traj.lengths)
        for r in range(N_ROLES):
            assert sch.cached_len(traj, r) == ref.kv.get(ref.owner(r), 0)


# non-round-robin: agent 2 first with a long prompt, agent 0 twice in a row, agent 1 comes back after a cut
ASYMMETRIC = [
    (2, 17, 4, None),
    (0, 3, 1, None),
    (0, 5, 6, None),
    (1, 2, 0, None),
    (2, 9, 3, 20),
    (1, 1, 2, None),
    (0, 0, 5, None),
    (1, 4, 1, 7),
    (2, 6, 2, None),
]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_asymmetric_three_agent_session_plans_what_the_design_table_says(scheme):
    run_session(scheme, ASYMMETRIC)


turns = st.lists(
    st.tuples(
        st.integers(0, N_ROLES - 1),
        st.integers(0, 9),
        st.integers(0, 5),
        st.one_of(st.none(), st.integers(0, 40)),
    ),
    min_size=1,
    max_size=10,
)


@pytest.mark.parametrize("scheme", SCHEMES)
@settings(max_examples=25)
@given(schedule=turns)
def test_any_turn_order_plans_what_the_design_table_says(scheme, schedule):
    run_session(scheme, schedule)


def test_which_positions_each_agent_recomputes_in_a_fixed_session():
    """Agent 0 prefills 10 tokens, generates 4 (3 written); agent 2 then appends 5; agent 1 appends 2."""
    want = {
        "non_shared": [[Forward(0, 10)], [Forward(0, 19)], [Forward(0, 21)]],
        "full_shared": [[Forward(0, 10)], [Forward(13, 19)], [Forward(19, 21)]],
        "droidspeak": [[Forward(0, 10)], [Recompute(0, 13), Forward(13, 19)], [Recompute(0, 19), Forward(19, 21)]],
        "base_shared": [[Forward(0, 10)], [LRPrefill(0, 13), Forward(13, 19)], [LRPrefill(0, 19), Forward(19, 21)]],
        "base_lr_shared": [[Forward(0, 10)], [Forward(13, 19)], [Forward(19, 21)]],
    }
    for scheme, plans in want.items():
        sch = make_scheme(scheme, N_ROLES, n_layers=3, droidspeak_layers=[1])
        traj = Trajectory(ids=list(range(10)))
        got = []
        for role, appended, generated in [(0, 0, 4), (2, 5, 0), (1, 2, 0)]:
            traj.ids.extend(range(appended))
            ops = sch.plan(traj, role)
            got.append(ops)
            for op in ops:
                sch.record(traj, role, op)
            n0 = len(traj.ids)
            traj.ids.extend(range(generated))
            if generated > 1:
                sch.record_forward(traj, role, n0, n0 + generated - 1)
            sch.finish_step(traj, role)
        assert got == plans, scheme
    # the same role again with nothing new: only its last position is forwarded again (its logits are needed)
    sch = make_scheme("droidspeak", N_ROLES, n_layers=3, droidspeak_layers=[1])
    traj = Trajectory(ids=[5, 6, 7], lengths={"kv": 3, "hidden": 3}, seen={1: 3})
    assert sch.plan(traj, 1) == [Forward(2, 3)]
    # a role that saw a prefix recomputes only the part after it, and the catch-up stops short of the last position
    traj = Trajectory(ids=list(range(8)), lengths={"kv": 8, "hidden": 8}, seen={0: 3})
    assert sch.plan(traj, 0) == [Recompute(3, 7), Forward(7, 8)]
    assert make_scheme("base_shared", N_ROLES).plan(traj, 0) == [LRPrefill(3, 7), Forward(7, 8)]
    assert make_scheme("full_shared", N_ROLES).plan(traj, 0) == [Forward(7, 8)]


def test_lr_prefill_records_only_the_role_own_low_rank_cache():
    sch = BaseShared(N_ROLES, rows=2)
    traj = Trajectory(ids=list(range(9)), lengths={"kv": 9, "lr:0": 9})
    sch.record(traj, 2, LRPrefill(0, 6))
    assert traj.lengths == {"kv": 9, "lr:0": 9, "lr:2": 6}
    sch.record(traj, 2, Forward(6, 9))
    assert traj.lengths == {"kv": 9, "lr:0": 9, "lr:2": 9}
    # a recompute records nothing in the base class (DroidSpeak rewrites in place, lengths stay)
    ds = DroidSpeak(N_ROLES, n_layers=3, droidspeak_layers=[1])
    traj = Trajectory(ids=list(range(5)), lengths={"kv": 5, "hidden": 5})
    ds.record(traj, 1, Recompute(0, 4))
    assert traj.lengths == {"kv": 5, "hidden": 5}
    # a forward that starts below the cached length cuts the cache at its end
    fs = FullShared(N_ROLES)
    traj = Trajectory(ids=list(range(9)), lengths={"kv": 9})
    fs.record_forward(traj, 0, 2, 4)
    assert traj.lengths == {"kv": 4}


def test_truncate_clips_ids_lengths_and_seen():
    sch = NonShared(N_ROLES)
    traj = Trajectory(ids=list(range(10)), lengths={"kv:0": 10, "kv:2": 4}, seen={0: 10, 2: 3, 1: 6})
    sch.truncate(traj, 5)
    assert traj.ids == [0, 1, 2, 3, 4]
    assert traj.lengths == {"kv:0": 5, "kv:2": 4}
    assert traj.seen == {0: 5, 2: 3, 1: 5}
    sch.truncate(traj, 99)  # past the end: nothing changes
    assert traj.ids == [0, 1, 2, 3, 4] and traj.lengths == {"kv:0": 5, "kv:2": 4}
    sch.truncate(traj, -3)  # below zero: empty
    assert traj.ids == [] and traj.lengths == {"kv:0": 0, "kv:2": 0} and traj.seen == {0: 0, 2: 0, 1: 0}


def test_finish_step_sees_only_what_the_role_cache_holds():
    sch = NonShared(N_ROLES)
    traj = Trajectory(ids=list(range(10)), lengths={"kv:1": 7, "kv:0": 12})
    sch.finish_step(traj, 1)
    sch.finish_step(traj, 0)
    sch.finish_step(traj, 2)
    assert traj.seen == {1: 7, 0: 10, 2: 0}


def test_empty_trajectory_plan_is_a_one_line_error():
    for scheme in SCHEMES:
        with pytest.raises(ValueError, match="^the trajectory is empty: append tokens before a step$"):
            make_scheme(scheme, 2).plan(Trajectory(), 0)


# ---- layouts ------------------------------------------------------------------------------------------------------
def test_slots_per_role_and_row():
    rows = 4
    ns = make_scheme("non_shared", N_ROLES, rows)
    assert (ns.kv_slots, ns.lr_slots) == (12, 0)
    assert [ns.kv_slot(r, j) for j in range(3) for r in range(rows)] == list(range(12))
    assert ns.kv_name(2) == "kv:2" and ns.written_by_forward(1) == ("kv:1",)
    bs = make_scheme("base_shared", N_ROLES, rows)
    assert (bs.kv_slots, bs.lr_slots) == (4, 12)
    assert [bs.lr_slot(r, j) for j in range(3) for r in range(rows)] == list(range(12))
    assert {bs.kv_slot(r, j) for j in range(3) for r in [2]} == {2}
    assert bs.written_by_forward(2) == ("kv", "lr:2") and bs.kv_name(2) == "kv"
    for name in ("full_shared", "droidspeak", "base_lr_shared"):
        s = make_scheme(name, N_ROLES, rows, n_layers=3)
        assert s.kv_slots == 4
        assert [s.kv_slot(r, j) for r in range(rows) for j in range(3)] == [r for r in range(rows) for _ in range(3)]
        assert [s.lr_slot(r, j) for r in range(rows) for j in range(3)] == [r for r in range(rows) for _ in range(3)]
        assert [s.hidden_slot(r) for r in range(rows)] == [0, 1, 2, 3]
        assert s.kv_name(1) == "kv"
    assert make_scheme("base_lr_shared", N_ROLES, rows).lr_slots == 4
    assert make_scheme("base_lr_shared", N_ROLES, rows).written_by_forward(0) == ("kv", "lr")
    assert make_scheme("droidspeak", N_ROLES, rows, n_layers=3).written_by_forward(0) == ("kv", "hidden")
    assert make_scheme("full_shared", N_ROLES, rows).written_by_forward(0) == ("kv",)


def test_pool_layouts_of_each_scheme():
    kw = {"n_kv_heads": 2, "head_dim": 8, "rank": 4, "hidden_size": 32}
    base = {"n_layers": 6, "n_kv_heads": 2, "head_dim": 8}
    want = {
        "non_shared": PoolLayout(**base, kv_slots=6),
        "full_shared": PoolLayout(**base, kv_slots=2),
        "droidspeak": PoolLayout(**base, kv_slots=2, hidden_layers=(1, 4), hidden_slots=2, hidden_size=32),
        "base_shared": PoolLayout(**base, kv_slots=2, lr_slots=6, rank=4),
        "base_lr_shared": PoolLayout(**base, kv_slots=2, lr_slots=2, rank=4),
    }
    for name, layout in want.items():
        s = make_scheme(name, N_ROLES, rows=2, n_layers=6, droidspeak_layers=[4, 1, 2])
        assert s.layout(**kw) == layout, name
    assert make_scheme("droidspeak", N_ROLES, rows=2, n_layers=6, droidspeak_layers=[4, 1, 2]).groups == [
        (1, 3),
        (4, 5),
    ]


def test_memory_accounting_non_shared_is_n_times_full_shared_and_lr_adds_only_rank_wide_caches():
    """Every role has processed the whole 30-token trajectory (DESIGN.md §2's accounting)."""
    layouts = {}
    got = {}
    for name in SCHEMES:
        s = make_scheme(name, N_ROLES, rows=1, n_layers=4, droidspeak_layers=[1])
        layout = s.layout(n_kv_heads=2, head_dim=16, rank=4, hidden_size=64)
        layouts[name] = layout
        traj = Trajectory(ids=list(range(30)))
        for role in (1, 0, 2):
            for op in s.plan(traj, role):
                s.record(traj, role, op)
            s.finish_step(traj, role)
        got[name] = s.component_bytes(traj, layout.bytes_per_position(2))
    kv = 30 * 4 * 2 * 16 * 2
    assert got["full_shared"] == {"k": kv, "v": kv}
    assert got["non_shared"] == {"k": 3 * kv, "v": 3 * kv}
    assert got["droidspeak"] == {"k": kv, "v": kv, "hidden": 30 * 64 * 2}
    assert got["base_lr_shared"] == {"k": kv, "v_base": kv, "v_lr": 30 * 4 * 4 * 2}
    assert got["base_shared"] == {"k": kv, "v_base": kv, "v_lr": 3 * 30 * 4 * 4 * 2}


# ---- DroidSpeak layer groups --------------------------------------------------------------------------------------
@settings(max_examples=40)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), min_size=1))))
def test_groups_are_the_sorted_contiguous_runs_of_the_layers(case):
    n, layers = case
    groups = groups_from_layers(layers, n)
    covered = [i for a, b in groups for i in range(a, b)]
    assert covered == sorted(set(layers))
    assert all(b > a for a, b in groups)
    assert all(b1 < a2 for (_, b1), (a2, _) in zip(groups, groups[1:], strict=False))  # gaps between groups


def test_groups_examples_and_errors():
    assert groups_from_layers([3, 0, 1, 1, 5], 6) == [(0, 2), (3, 4), (5, 6)]
    assert groups_from_layers([0], 1) == [(0, 1)]
    assert groups_from_layers([5, 4], 6) == [(4, 6)]
    for layers, bad in [([0, 6], [6]), ([-1, 2], [-1]), ([True], [True]), ([1.0], [1.0])]:
        msg = re.escape(f"droidspeak layers {bad} invalid: allowed non-empty subset of 0..5")
        with pytest.raises(ValueError, match=f"^{msg}$"):
            groups_from_layers(layers, 6)
    with pytest.raises(ValueError, match=r"^droidspeak layers \[\] invalid: allowed non-empty subset of 0\.\.5$"):
        groups_from_layers([], 6)


def test_default_droidspeak_layers_are_the_middle_third():
    assert [default_droidspeak_layers(n) for n in (1, 2, 3, 4, 6, 9, 30)] == [
        [0],
        [0],
        [1],
        [1],
        [2, 3],
        [3, 4, 5],
        list(range(10, 20)),
    ]
    assert DroidSpeak(2, n_layers=9).groups == [(3, 6)]
    assert make_scheme("droidspeak", 2, n_layers=9).hidden_layers == (3,)
    assert make_scheme("droidspeak", 2, n_layers=9, droidspeak_layers=[0, 8]).hidden_layers == (0, 8)


# ---- construction -------------------------------------------------------------------------------------------------
def test_make_scheme_builds_each_class_with_its_arguments():
    classes = {
        "non_shared": NonShared,
        "full_shared": FullShared,
        "droidspeak": DroidSpeak,
        "base_shared": BaseShared,
        "base_lr_shared": BaseLRShared,
    }
    for name, cls in classes.items():
        s = make_scheme(Scheme(name), 3, 5, shared_a=True, n_layers=7)
        assert type(s) is cls and s.scheme == Scheme(name)
        assert (s.n_roles, s.rows, s.shared_a, s.n_layers) == (3, 5, True, 7)
        assert s.decomposed == (name in ("base_shared", "base_lr_shared"))
        assert s.consumer_reads_producer_cache == (name in ("full_shared", "base_lr_shared"))
        assert s.catch_up(1, 4) == {"droidspeak": Recompute(1, 4), "base_shared": LRPrefill(1, 4)}.get(name)
        assert s.hidden_layers == ((2,) if name == "droidspeak" else ())
    assert make_scheme("base_shared", 2, shared_a=False).shared_a is False
    assert make_scheme("non_shared", 2).rows == 1 and make_scheme("non_shared", 2).n_layers == 1
    with pytest.raises(ValueError, match="non_shared"):
        make_scheme("no_such_scheme", 2)


def test_bad_construction_is_a_one_line_error():
    for n_roles, rows in [(0, 1), (1, 0), (0, 0), (-1, 3)]:
        with pytest.raises(
            ValueError, match=rf"^need at least one role and one row, got n_roles={n_roles}, rows={rows}$"
        ):
            FullShared(n_roles, rows)
    assert FullShared(1, 1).n_roles == 1
    with pytest.raises(ValueError, match="^scheme base_lr_shared needs shared A: with one A per role"):
        make_scheme("base_lr_shared", 2, shared_a=False)
    with pytest.raises(ValueError, match=r"use base_shared instead$"):
        BaseLRShared(2, shared_a=False)
    assert isinstance(SharingScheme(2), SharingScheme)


def test_trajectory_defaults_and_lengths():
    t = Trajectory()
    assert (t.ids, t.lengths, t.seen) == ([], {}, {})
    assert t.length("kv") == 0
    t.lengths["kv"] = 4
    assert t.length("kv") == 4 and t.length("lr") == 0
    assert Trajectory().ids is not t.ids


def test_direct_construction_defaults():
    s = FullShared(2)
    assert (s.rows, s.shared_a, s.n_layers) == (1, True, 1)
    assert BaseLRShared(2).lr_slots == 1  # shared A by default: no error
    assert s.layout(n_kv_heads=1, head_dim=2, rank=1, hidden_size=4).n_layers == 1


def test_base_lr_shared_without_shared_a_names_the_remedy():
    msg = (
        "scheme base_lr_shared needs shared A: with one A per role (shared_a=False) the low-rank cache "
        "X·A of one role means nothing to another; use base_shared instead"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        BaseLRShared(2, shared_a=False)
