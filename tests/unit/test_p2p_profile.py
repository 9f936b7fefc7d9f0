"""A profile carries measured point-to-point figures (``meta.p2p``) that replace the NCCL model's defaults.

What a measuring run writes, and what the loader accepts::

    meta:
      p2p:
        intra_node: {latency_us: 9.5, bandwidth_GBps: 355.0}   # one message to a peer on the node
        inter_node: {latency_us: 24.0, bandwidth_GBps: 47.0}   # to another node, every rank sending

Every key is optional; a missing one keeps the model's default.
"""

from __future__ import annotations

import pathlib

import pytest
import yaml

from colltune.model import nccl
from colltune.model.profile import ProfileError, load_profile, save_profile

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _with_p2p(tmp_path: pathlib.Path, p2p: object) -> pathlib.Path:
    doc = yaml.safe_load((REPO / "profiles" / "analytic-nccl.yaml").read_text())
    doc["meta"]["p2p"] = p2p
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_profile_carries_measured_p2p_figures(tmp_path: pathlib.Path) -> None:
    figures = {"intra_node": {"latency_us": 9.5, "bandwidth_GBps": 355.0},
               "inter_node": {"latency_us": 24.0, "bandwidth_GBps": 47.0}}
    prof = load_profile(_with_p2p(tmp_path, figures))
    assert prof.meta["p2p"] == figures
    measured = nccl.P2P.from_meta(prof.meta["p2p"])
    assert measured == nccl.P2P(intra_latency_us=9.5, intra_GBps=355.0, inter_latency_us=24.0, inter_GBps=47.0)
    topo = nccl.Topology(4, 8, prof.meta["gpu"], p2p=measured)
    assert nccl.p2p_time_us(1 * MiB, topo) == pytest.approx(24.0 + 1 * MiB / 47e3)
    save_profile(prof, tmp_path / "again.yaml")  # the figures survive a round trip
    assert load_profile(tmp_path / "again.yaml").meta["p2p"] == figures


@pytest.mark.parametrize("p2p,key", [
    ({"inter_node": {"bandwidth_GBps": -3}}, "bandwidth_GBps"),
    ({"inter_node": {"latency_us": "fast"}}, "latency_us"),
    ({"across": {"latency_us": 1.0}}, "across"),
    ({"intra_node": {"latency_us": 1.0, "jitter_us": 0.1}}, "intra_node"),
    ("48 GB/s", "meta.p2p"),
])
def test_the_loader_refuses_bad_p2p_figures(tmp_path: pathlib.Path, p2p: object, key: str) -> None:
    with pytest.raises(ProfileError, match="meta.p2p") as info:
        load_profile(_with_p2p(tmp_path, p2p))
    assert key in str(info.value) and "measured.yaml" in str(info.value)


def test_the_shipped_profile_keeps_the_defaults() -> None:
    assert load_profile(REPO / "profiles" / "analytic-nccl.yaml").meta.get("p2p") is None


def test_the_cost_model_prices_point_to_point_steps_with_the_profiles_figures(tmp_path: pathlib.Path) -> None:
    from colltune.model.features import Features
    from colltune.select.selector import model_for_profile

    call = Features.uniform(numel=2**22, row_numel=64, dtype="float32", k=20_000, world_size=32, union=400_000,
                            ranks_per_node=8)
    shipped = model_for_profile(load_profile(REPO / "profiles" / "analytic-nccl.yaml"), "shipped")
    slow = {"inter_node": {"latency_us": 24.0, "bandwidth_GBps": 4.8}}  # a tenth of the default NIC share
    measured = model_for_profile(load_profile(_with_p2p(tmp_path, slow)), "measured")
    assert measured.analytic.network.p2p == nccl.P2P.from_meta(slow)
    before, after = shipped.analytic.terms(call), measured.analytic.terms(call)
    p2p_terms = [(a, t) for a, steps in shipped.analytic.schedule(call).items() for s in steps
                 if s.primitive in ("p2p", "all_to_all") and s.nbytes > 0 for t in [s.term]]
    assert p2p_terms, "some algorithm sends point to point across nodes here"
    for algorithm, term in p2p_terms:
        assert after[algorithm][term] > before[algorithm][term], (algorithm, term)
    assert after["dense"]["value_all_reduce"] == before["dense"]["value_all_reduce"]  # collectives: NCCL's model
