"""Find causal GQA attention in a traced graph by its dataflow, and recover what the rewrite needs.

Recognised forms (anchored on the attention op, then walked along use-def links, never by names):
    sdpa:   scaled_dot_product_attention(q, k, v, is_causal=True[, enable_gqa=True])  k/v plain or repeat_kv'd
    eager:  matmul(softmax(matmul(q, k^T) * scale + mask), v)                           mask proven causal
where q = apply_rope(norm?(view(Linear_q(x)))) transposed to [B, H, T, D], k the same with Linear_k(x), and
v = view(Linear_v(x)) transposed. The match is stored, typed, in node.meta["m3_attention"] of the output node.
When an anchor does not fit, the MatchFailure names the node that broke the pattern.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from m3compile.graph.tracing import is_norm_module, propagate_shapes
from m3compile.ops import apply_rope, is_op, msa_attention, msa_attention_lse, op_args

__all__ = ["AttentionMatch", "MatchFailure", "find_attention", "msa_nodes", "msa_layer", "META_KEY"]

META_KEY = "m3_attention"
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SOFTMAX_FN = {F.softmax, torch.softmax, torch.nn.functional.softmax}
_MATMUL_FN = {torch.matmul, operator.matmul, torch.bmm}
_CAST_METHODS = {"to", "float", "type_as", "contiguous", "half", "bfloat16", "clone"}
_REPEAT_METHODS = {"reshape", "view", "expand", "unsqueeze", "repeat_interleave", "contiguous", "flatten"}


@dataclass
class AttentionMatch:
    """One causal GQA attention found in the graph: everything the GQA -> MSA rewrite needs."""

    layer: int
    prefix: str  # module path of the attention block, e.g. "model.layers.3.self_attn"
    form: str  # "sdpa", "sdpa_repeat" or "eager"
    output: Node  # value [B, Hq, T, D] that the rewrite replaces
    x: Node  # hidden states feeding q/k/v projections [B, T, hidden]
    q: Node  # [B, Hq, T, D], RoPE applied
    k: Node  # [B, Hkv, T, D], RoPE applied, not repeated
    v: Node  # [B, Hkv, T, D], not repeated
    q_proj: str
    k_proj: str
    v_proj: str
    q_norm: str | None
    k_norm: str | None
    cos: Node
    sin: Node
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    scale: float

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


@dataclass
class MatchFailure:
    anchor: Node
    node: Node
    reason: str

    def __str__(self) -> str:
        return f"attention at node {self.anchor.name!r}: node {self.node.name!r} ({_describe(self.node)}) {self.reason}"


class _NoMatch(Exception):
    def __init__(self, node: Node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def _describe(n: Node) -> str:
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"{n.op} {target}"


def _is_method(n, names) -> bool:
    return isinstance(n, Node) and n.op == "call_method" and n.target in names


def _is_fn(n, fns) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in fns


def _shape(n: Node) -> tuple[int, ...]:
    val = n.meta.get("val")
    if val is None:
        raise _NoMatch(n, "has no shape; run propagate_shapes first")
    return tuple(val.shape)


def _skip_casts(n: Node) -> Node:
    while _is_method(n, _CAST_METHODS) or _is_fn(n, {F.dropout}):
        n = n.args[0]
    return n


def _expect_head_major(n: Node, what: str) -> Node:
    """n = x.transpose(1, 2) (or permute(0, 2, 1, 3)) of a [B, T, H, D] value; returns that value."""
    n = _skip_casts(n)
    if _is_method(n, {"transpose"}) and sorted(a % 4 for a in n.args[1:3]) == [1, 2]:
        return n.args[0]
    if _is_method(n, {"permute"}) and tuple(n.args[1:]) in ((0, 2, 1, 3),):
        return n.args[0]
    raise _NoMatch(n, f"is not the [B, T, H, D] -> [B, H, T, D] transpose expected for {what}")


def _peel_repeat(n: Node) -> Node:
    """Walk back through repeat_kv (index/unsqueeze, expand, reshape) to the un-repeated [B, Hkv, T, D] value."""
    while _is_method(n, _REPEAT_METHODS) or (
        _is_fn(n, {operator.getitem, torch.repeat_interleave}) and isinstance(n.args[0], Node)
    ):
        if _is_method(n, {"transpose", "permute"}):
            break
        n = n.args[0]
    return n


class _Matcher:
    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.fake_runs: dict[int, dict] = {}  # seq_len -> node values, shared by every mask check

    def _module(self, n: Node):
        return self.modules.get(n.target) if isinstance(n, Node) and n.op == "call_module" else None

    def projection(self, n: Node, what: str, roped: bool):
        """Walk [B, T, H, D] value back to (Linear target, input x, norm target, rope node)."""
        rope = None
        if roped:
            if not _is_fn(n, {apply_rope}):
                raise _NoMatch(n, f"is not the rotary embedding (apply_rope) expected on {what}")
            rope, n = n, op_args(n)["x"]
        norm = None
        if self._module(n) is not None and is_norm_module(self._module(n)):
            norm, n = n.target, n.args[0]
        if not _is_method(n, {"view", "reshape", "unflatten"}):
            raise _NoMatch(n, f"is not the head split (view/reshape) expected for {what}")
        n = n.args[0]
        if not isinstance(self._module(n), torch.nn.Linear):
            raise _NoMatch(n, f"is not the nn.Linear projection expected for {what}")
        return n.target, n.args[0], norm, rope

    def match(self, anchor: Node) -> AttentionMatch:
        if _is_fn(anchor, _SDPA):
            form, q, k, v, output, scale = self._sdpa(anchor)
        else:
            form, q, k, v, output, scale = self._eager(anchor)
        q_in, k_in, v_in = _expect_head_major(q, "q"), _expect_head_major(k, "k"), _expect_head_major(v, "v")
        q_proj, xq, q_norm, q_rope = self.projection(q_in, "q", True)
        k_proj, xk, k_norm, k_rope = self.projection(k_in, "k", True)
        v_proj, xv, _, _ = self.projection(v_in, "v", False)
        if not (xq is xk is xv):
            raise _NoMatch(anchor, "reads q, k and v from different inputs; expected one hidden state")
        q_tables, k_tables = op_args(q_rope), op_args(k_rope)
        if q_tables["cos"] is not k_tables["cos"] or q_tables["sin"] is not k_tables["sin"]:
            raise _NoMatch(k_rope, "rotates k with other cos/sin tables than q")
        _, hq, _, d = _shape(q)
        _, hkv, _, dk = _shape(k)
        if d != dk or hq % hkv:
            raise _NoMatch(anchor, f"has {hq} query and {hkv} KV heads of dims {d}/{dk}: not a GQA pair")
        prefix = q_proj.rsplit(".", 1)[0]
        m = re.search(r"layers\.(\d+)\.", q_proj)
        layer = int(m[1]) if m else -1
        return AttentionMatch(
            layer=layer, prefix=prefix, form=form, output=output, x=xq, q=_skip_casts(q), k=k, v=v,
            q_proj=q_proj, k_proj=k_proj, v_proj=v_proj, q_norm=q_norm, k_norm=k_norm, cos=q_tables["cos"],
            sin=q_tables["sin"], n_heads=hq, n_kv_heads=hkv, head_dim=d, rope_dim=_shape(q_tables["cos"])[-1],
            scale=d**-0.5 if scale is None else scale,
        )

    def _sdpa(self, n: Node):
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        a = dict(zip(names, n.args))
        a.update(n.kwargs)
        if a.get("attn_mask") is not None:
            if not _mask_is_causal(self.gm, a["attn_mask"], "sdpa", self.fake_runs):
                raise _NoMatch(a["attn_mask"], "is an attention mask that is not causal")
        elif not a.get("is_causal", False):
            raise _NoMatch(n, "is not causal (is_causal=False and no mask)")
        k, v = _peel_repeat(a["key"]), _peel_repeat(a["value"])
        form = "sdpa" if k is a["key"] else "sdpa_repeat"
        if _shape(a["query"])[1] != _shape(k)[1] and form == "sdpa" and not a.get("enable_gqa", False):
            raise _NoMatch(n, "has fewer KV than query heads without enable_gqa")
        return form, a["query"], k, v, n, a.get("scale")

    def _eager(self, softmax: Node):
        users = [_skip_forward(u) for u in softmax.users]
        out = next((u for u in users if _is_fn(u, _MATMUL_FN)), None)
        if out is None:
            raise _NoMatch(softmax, "is a softmax whose result does not feed a matmul with V")
        scores = _skip_casts(softmax.args[0])
        if _is_fn(scores, {operator.add, torch.add}) or _is_method(scores, {"add"}):
            mask, scores = scores.args[1], scores.args[0]
            kind = "additive"
        elif _is_method(scores, {"masked_fill"}) or _is_fn(scores, {torch.masked_fill}):
            mask, scores = scores.args[1], scores.args[0]
            kind = "fill"
        else:
            raise _NoMatch(scores, "is not a causal mask applied to the scores (add or masked_fill)")
        if not _mask_is_causal(self.gm, mask, kind, self.fake_runs):
            raise _NoMatch(mask, "is an attention mask that is not causal")
        scale = None
        if _is_fn(scores, {operator.mul, operator.truediv}) and isinstance(scores.args[1], (int, float)):
            scale = scores.args[1] if scores.target is operator.mul else 1.0 / scores.args[1]
            scores = scores.args[0]
        if not _is_fn(scores, _MATMUL_FN):
            raise _NoMatch(scores, "is not the q @ k^T matmul expected before the softmax")
        q, kt = scores.args
        if not (_is_method(kt, {"transpose"}) and sorted(a % 4 for a in kt.args[1:3]) == [2, 3]):
            raise _NoMatch(kt, "is not k transposed over its last two dims")
        if scale is None:
            raise _NoMatch(scores, "has no constant softmax scale after it")
        return "eager", q, _peel_repeat(kt.args[0]), _peel_repeat(out.args[1]), out, scale


def _skip_forward(n: Node) -> Node:
    while (_is_method(n, _CAST_METHODS) or _is_fn(n, {F.dropout})) and len(n.users) == 1:
        n = next(iter(n.users))
    return n


def _is_dtype_or_device(n: Node) -> bool:
    """x.dtype, x.device, x.shape, x.size(): properties of x, not of its values; taken from a fake run."""
    return (_is_fn(n, {getattr}) and n.args[1] in ("dtype", "device", "shape")) or _is_method(n, {"size", "dim"})


def _mask_is_causal(gm: torch.fx.GraphModule, mask: Node, kind: str, fake_runs: dict[int, dict]) -> bool:
    """Evaluate the mask's subgraph for two short inputs and check it allows exactly the causal pairs."""
    if not isinstance(mask, Node):
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.op == "call_module":
            return False  # a mask computed from weights is not a structural causal mask
        needed.add(n)
        if not _is_dtype_or_device(n):  # x.dtype / x.device: a property of x, not its values
            stack.extend(n.all_input_nodes)
    for length in (5, 9):
        env: dict[Node, object] = {}
        if length not in fake_runs:
            fake_runs[length] = {}
            propagate_shapes(gm, seq_len=length, record=fake_runs[length])
        fake = fake_runs[length]
        for n in sorted(needed, key=order.get):
            if _is_dtype_or_device(n):
                value = fake[n]
                env[n] = torch.device("cpu") if isinstance(value, torch.device) else value
                continue
            args = torch.fx.node.map_arg(n.args, lambda a: env[a])
            kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: env[a])
            if n.op == "placeholder":
                env[n] = torch.zeros(1, length, dtype=torch.long)
            elif n.op == "get_attr":
                obj = gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                if isinstance(obj, torch.Tensor) and obj.is_meta:
                    return False
                env[n] = obj
            elif n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        value = env[mask]
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-2:] != (length, length):
            return False
        value = value.reshape(-1, length, length)
        if kind == "additive":
            allowed = value == 0
            blocked_ok = bool((value[~allowed] <= -1e4).all()) if (~allowed).any() else True
            if not blocked_ok:
                return False
        elif kind == "fill":
            allowed = ~value.bool()
        else:  # sdpa: boolean True = attend, float = additive
            allowed = value.bool() if value.dtype == torch.bool else value == 0
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if not bool((allowed == causal).all()):
            return False
    return True


def find_attention(gm: torch.fx.GraphModule) -> tuple[list[AttentionMatch], list[MatchFailure]]:
    """All causal GQA attentions of a shape-propagated graph, and the anchors that did not match (with why)."""
    matcher = _Matcher(gm)
    matches, failures = [], []
    for n in list(gm.graph.nodes):
        is_softmax = _is_fn(n, _SOFTMAX_FN) or _is_method(n, {"softmax"})
        if not (_is_fn(n, _SDPA) or is_softmax):
            continue
        try:
            m = matcher.match(n)
        except _NoMatch as e:
            failures.append(MatchFailure(n, e.node, e.reason))
            continue
        m.output.meta[META_KEY] = m
        matches.append(m)
    return matches, failures


def msa_nodes(gm: torch.fx.GraphModule) -> list[Node]:
    """The block-sparse attention nodes already in the graph (MSA layers; msa_attention_lse where a distillation
    hook reads the attention's log-sum-exp)."""
    return [n for n in gm.graph.nodes if is_op(n, msa_attention, msa_attention_lse)]


def msa_layer(n: Node) -> int:
    """The decoder layer of an MSA attention node: recorded by gqa_to_msa, or read from the module path of what its
    blocks come from (the index weights `...layers.{i}.self_attn.index_q_proj.weight`) in a natively traced MSA
    model. -1 when unknown."""
    if "m3_msa_layer" in n.meta:
        return n.meta["m3_msa_layer"]
    todo, seen = [op_args(n)["blocks"]], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur.op in ("call_module", "get_attr"):  # the index projections' modules or weights
            m = re.search(r"layers\.(\d+)\.", str(cur.target))
            if m:
                return int(m[1])
        todo.extend(cur.all_input_nodes)
    return -1
