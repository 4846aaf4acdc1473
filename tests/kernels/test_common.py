"""kernels/_common.py: what every kernel wrapper shares."""
import pytest

from m3compile.kernels import _common


@pytest.mark.parametrize("env, cached", [(None, True), ("0", False)])
def test_autotune_keeps_choices_on_disk_unless_turned_off(monkeypatch, env, cached):
    triton = pytest.importorskip("triton")
    seen = {}
    monkeypatch.setattr(triton, "autotune", lambda configs, key, cache_results=False, **kw: seen.update(
        cache_results=cache_results, key=key))
    if env is None:
        monkeypatch.delenv("M3C_AUTOTUNE_CACHE", raising=False)
    else:
        monkeypatch.setenv("M3C_AUTOTUNE_CACHE", env)
    _common.autotune(configs=[], key=["T"])
    assert seen == {"cache_results": cached, "key": ["T"]}


def test_autotune_without_cache_support_tunes_as_before(monkeypatch):
    triton = pytest.importorskip("triton")
    seen = {}
    monkeypatch.setattr(triton, "autotune", lambda configs, key, **kw: seen.update(kw, key=key))
    _common.autotune(configs=[], key=["T"])
    assert seen == {"key": ["T"]}  # a Triton whose autotune has no cache_results gets no such argument


def test_every_autotuned_kernel_goes_through_the_caching_wrapper():
    """No module calls triton.autotune directly (it would tune again in every process)."""
    from pathlib import Path

    sources = {p.name: p.read_text() for p in Path(_common.__file__).parent.rglob("_tl_*.py")}
    assert sources and not [n for n, s in sources.items() if "@triton.autotune" in s]
    # (the decode selection's bf16 and fp8 entry points are two calls of one `return autotune(...)`)
    assert sum(s.count("@autotune(") + s.count("return autotune(") for s in sources.values()) == 10
