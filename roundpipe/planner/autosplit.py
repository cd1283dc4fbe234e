"""Cutting any nn.Module into layers: `RoundPipe(module)` for a module that is not a list of layers.

The engine runs a sequence of layers, each taking the previous one's output.  A model
written as a class (torchvision's ResNet, a ViT, a hand-written network) calls its
submodules in order from its `forward`; `split_module` recovers that sequence:

1. **Trace.**  `torch.fx` traces the module's `forward` with its children as leaf modules,
   giving its top-level dataflow: which child (or function) consumes which value.
2. **Cut.**  Between two consecutive nodes of that graph, the values computed before and
   read after are what would have to flow from one layer to the next.  A cut is made
   wherever that is exactly one value (a tensor, or a child's whole output), so a residual
   connection that spans children keeps them in one piece.  A piece without parameters
   (an activation, a pooling, a flatten) joins the piece before it (the first one, the
   piece after it).
3. **Split large pieces.**  A piece holding more than `max_share` of the module's
   parameters (1/8 by default), or, with a device cap, whose weights in the compute dtype
   plus their fp32 gradient accumulators exceed a quarter of the smallest cap (a stage
   gets half the cap, and a layer leaves room in it for activations), is split further:
   its heaviest child that has children of its own is traced through as well (step 1 one
   level deeper) and the cuts are looked for again.  A child whose inside has no cut (a
   residual block) or cannot be traced stays whole (the latter with a warning).  A forward that is one
   step (`return self.body(x)`, the published system's quick-start ResNet) is one such piece.  Weight
   is the criterion because it is what a worker must hold; the planner then balances
   the layers' times (docs/planner.md).

Each piece is an `fx.GraphModule` over the module's own submodules and parameters (shared,
not copied): the first takes the module's arguments, each later one the value at its cut.
Attribute paths are kept, so the RoundPipe presents the module's own names
(`layer1.0.conv1.weight`) in `parameters()`, `state_dict()` and checkpoints.  Parameters
and buffers no traced call reads are attached to the last piece, so every one of the
module's tensors is the engine's.

What tracing cannot see, and the errors: data-dependent control flow, `.item()` or
non-tensor values steering the `forward` make fx fail, and the error names the module,
its class, fx's reason and the line; an argument of `forward` that defaults to None is traced
as None (fx cannot see whether a proxy is None), so passing it is an error; a `forward` that reads `self.training` would be
fixed at the trace's value, so the module is traced in both modes and rejected if they
differ; forward hooks of the module itself are not run (its children's are).  A Hugging
Face causal LM is pointed to `rp.hf.wrap`, which knows its loss and masks.  In all these
cases a list of layers (or an nn.Sequential) can be passed instead.
"""
from __future__ import annotations

import inspect
import os
import traceback
import warnings

import torch
from torch import fx, nn

MAX_SHARE = 1 / 8   # a piece holding more of the module's parameters is split further

# calls whose result is never a tensor: a cut must not hand one of these to the next layer
_NON_TENSOR_METHODS = frozenset({"size", "dim", "numel", "nelement", "item", "tolist", "stride", "element_size",
                                 "is_contiguous", "data_ptr", "__len__"})
_TORCH_DIR = os.path.dirname(torch.__file__)


class SplitModule(nn.Sequential):
    """The layers cut from `source` by `split_module`, in order.  `source` (the user's module, not a
    submodule of this one) owns the names the RoundPipe presents."""

    def __init__(self, source: nn.Module, pieces: list[nn.Module], traced_none: tuple[str, ...] = ()):
        super().__init__(*pieces)
        self.__dict__["source"] = source   # not registered: its tensors are the pieces' own
        # arguments of source.forward that default to None, traced as None (`_unset_args`): the pieces take none
        self.__dict__["traced_none"] = traced_none

    def check_call(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A call's arguments for the pieces: those the cut traced as None left out where they are None; a
        TypeError (before any work) naming one given a value."""
        if not self.traced_none:
            return args, kwargs
        names = list(inspect.signature(self.source.forward).parameters)
        given = [names[i] for i, a in enumerate(args[:len(names)]) if names[i] in self.traced_none and a is not None]
        given += [k for k in kwargs if k in self.traced_none and kwargs[k] is not None]
        if given:
            raise TypeError(
                f"{type(self.source).__name__}.forward's argument {given[0]!r} defaults to None and was traced as "
                "None when rp.RoundPipe(module) cut the module into layers (torch.fx cannot see whether a value "
                "is None, so the layers were cut for the call without it); to pass it, give RoundPipe a list of "
                "layers that take it, or make the argument required in forward (docs/migrating.md)")
        while args and len(args) <= len(names) and names[len(args) - 1] in self.traced_none and args[-1] is None:
            args = args[:-1]
        return args, {k: v for k, v in kwargs.items() if k not in self.traced_none}

    def __getitem__(self, idx):
        if isinstance(idx, slice):   # nn.Sequential's slice rebuilds its own class
            return nn.Sequential(*list(self)[idx])
        return super().__getitem__(idx)


class _Tracer(fx.Tracer):
    """Traces through the root and the submodules named in `expand`; every other module is a leaf."""

    def __init__(self, expand: frozenset[str]):
        super().__init__()
        self.expand = expand

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.expand


def _describe(module: nn.Module, name: str) -> str:
    cls = type(module).__name__
    return f"the module ({cls})" if not name else f"submodule {name!r} ({cls})"


def _where(error: BaseException) -> str:
    """' at file:line' of the innermost frame of the traceback outside torch, or ''."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


class _Untraceable(ValueError):
    """A forward that cannot be traced; the message is the reason (fx's error and the line)."""


def _unset_args(root: nn.Module) -> tuple[str, ...]:
    """The arguments of root.forward that default to None."""
    return tuple(name for name, p in inspect.signature(root.forward).parameters.items() if p.default is None)


def _trace(root: nn.Module, expand: frozenset[str]) -> fx.Graph:
    """The dataflow of root's forward, traced through `expand`; _Untraceable when fx fails or the
    traced forwards read self.training."""
    # an argument that defaults to None is traced as None (`if mask is not None` cannot see a proxy's value);
    # fx then asserts at run time that it is not given
    unset = dict.fromkeys(_unset_args(root))
    try:
        graph = _Tracer(expand).trace(root, concrete_args=unset or None)
    except Exception as e:  # noqa: BLE001 - whatever the user's forward raised under tracing is the reason
        raise _Untraceable(f"torch.fx could not trace its forward: {type(e).__name__}: {e}{_where(e)}") from e
    traced = [root] + [root.get_submodule(n) for n in expand]
    modes = [m.training for m in traced]
    try:   # a forward reading self.training is fixed at the trace's value: trace the other mode too
        for m, mode in zip(traced, modes):
            m.training = not mode
        other = _Tracer(expand).trace(root, concrete_args=unset or None)
    except Exception:  # noqa: BLE001 - the mode itself steers the forward: as below
        other = None
    finally:
        for m, mode in zip(traced, modes):
            m.training = mode
    if other is None or other.python_code("self").src != graph.python_code("self").src:
        raise _Untraceable("its forward reads self.training, which a traced graph would fix at the mode it "
                           "was traced in")
    return graph


def _non_tensor(node: fx.Node) -> bool:
    """True when node's value is surely not a tensor (a size, a shape entry, arithmetic on those)."""
    if node.op == "call_method":
        return node.target in _NON_TENSOR_METHODS
    if node.op == "call_function":
        if node.target in (getattr, len):
            return True
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            inputs = node.all_input_nodes
            return bool(inputs) and all(_non_tensor(n) for n in inputs)
    return False


class _Cuts:
    """The nodes of a graph (placeholders, get_attr and output aside) and, after each, what flows on."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        order = {n: i for i, n in enumerate(self.nodes)}
        end = len(self.nodes)   # the output reads after every node
        values = [n for n in graph.nodes if n.op == "placeholder"] + self.nodes
        first = {n: order.get(n, -1) for n in values}
        last = {n: max((order.get(u, end) for u in n.users), default=-1) for n in values}
        self.live: list[list[fx.Node]] = []   # live[i]: values made at or before node i, read after it
        flowing: dict[fx.Node, None] = {v: None for v in values if first[v] < 0 <= last[v]}   # ordered set
        for i, n in enumerate(self.nodes):
            if last[n] > i:
                flowing[n] = None
            for v in [v for v in flowing if last[v] <= i]:
                del flowing[v]
            self.live.append(list(flowing))

    def points(self) -> list[int]:
        """Node indices after which exactly one value, a computed one that may be a tensor, flows on."""
        out, previous = [], None
        for i, live in enumerate(self.live[:-1]):
            if len(live) != 1 or live[0].op == "placeholder" or _non_tensor(live[0]) or live[0] is previous:
                continue
            out.append(i)
            previous = live[0]   # the same value at two cuts: the nodes between them are dead
        return out

    def narrowest(self) -> str:
        """Where the fewest values flow on, for the error when there is no cut."""
        if len(self.live) < 2:
            return "its forward has fewer than two steps"
        i = min(range(len(self.live) - 1), key=lambda j: len(self.live[j]))
        names = ", ".join(v.name for v in self.live[i])
        return f"at best {len(self.live[i])} values flow on from one step to the next: {names} after {self.nodes[i].name!r}"


def _tensors(root: nn.Module, nodes: list[fx.Node]) -> dict[int, torch.Tensor]:
    """The parameters and buffers the nodes read (call_module targets' and get_attr's), by id."""
    out = {}
    attrs = [i for n in nodes for i in n.all_input_nodes if i.op == "get_attr"]
    for n in [*nodes, *attrs]:
        if n.op == "call_module":
            m = root.get_submodule(n.target)
            out.update({id(t): t for t in [*m.parameters(), *m.buffers()]})
        elif n.op == "get_attr":
            t = _attr(root, n.target)
            if isinstance(t, torch.Tensor):
                out[id(t)] = t
    return out


def _attr(root: nn.Module, target: str):
    owner, _, leaf = target.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, leaf)


def _params(root: nn.Module, nodes: list[fx.Node]) -> list[torch.Tensor]:
    return [t for t in _tensors(root, nodes).values() if isinstance(t, nn.Parameter)]


def _segments(root: nn.Module, cuts: _Cuts) -> list[tuple[list[fx.Node], fx.Node | None]]:
    """(nodes, the value flowing out or None for the last) per piece, parameter-free pieces merged."""
    segs, start = [], 0
    for i in cuts.points():
        segs.append((cuts.nodes[start:i + 1], cuts.live[i][0]))
        start = i + 1
    segs.append((cuts.nodes[start:], None))
    merged: list[tuple[list[fx.Node], fx.Node | None]] = []
    for nodes, out in segs:
        if merged and (not _params(root, nodes) or not _params(root, merged[-1][0])):
            merged[-1] = (merged[-1][0] + nodes, out)   # no parameters: joins its neighbour
        else:
            merged.append((nodes, out))
    return merged


def _numel(params: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in params)


def _build(root: nn.Module, graph: fx.Graph, segs: list[tuple[list[fx.Node], fx.Node | None]]) -> list[nn.Module]:
    """One GraphModule per segment over root's own submodules; unread tensors go to the last one."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    read = {}
    for nodes, _ in segs:
        read.update(_tensors(root, nodes))
    read.update(_tensors(root, [n for n in graph.nodes if n.op == "get_attr"]))
    unread = [name for name, t in [*root.named_parameters(), *root.named_buffers()] if id(t) not in read]
    pieces, inflow = [], None
    for k, (nodes, out) in enumerate(segs):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if inflow is None:
            for p in placeholders:
                env[p] = g.node_copy(p)
        else:
            env[inflow] = g.placeholder(inflow.name)

        def arg(n: fx.Node, g=g, env=env) -> fx.Node:
            if n not in env:   # a get_attr (parameters used by several pieces are shared, not moved)
                env[n] = g.node_copy(n)
            return env[n]
        for n in nodes:
            env[n] = g.node_copy(n, arg)
        if out is None:
            for name in unread:   # every tensor of root belongs to a layer (p.grad stays None, as in PyTorch)
                g.get_attr(name)
            g.node_copy(output, arg)
        else:
            g.output(env[out])
        pieces.append(fx.GraphModule(root, g, class_name=f"{type(root).__name__}Part{k}"))
        inflow = out
    return pieces


def _is_hf_causal_lm(module: nn.Module) -> bool:
    mro = {c.__name__ for c in type(module).__mro__}
    name = type(module).__name__
    return "PreTrainedModel" in mro and ("GenerationMixin" in mro or "CausalLM" in name or "LMHead" in name)


def layer_budget(device_memory: int | None, compute_dtype: torch.dtype) -> int | None:
    """Parameters one piece may hold under a device cap of `device_memory` bytes (None: no cap): weights
    in the compute dtype plus fp32 gradient accumulators within a quarter of the cap."""
    if device_memory is None:
        return None
    return device_memory // 4 // (torch.empty((), dtype=compute_dtype).element_size() + 4)


def split_module(module: nn.Module, *, device_memory: int | None = None, compute_dtype: torch.dtype = torch.float32,
                 max_share: float = MAX_SHARE) -> SplitModule:
    """`module` cut into consecutive layers at the points of its forward where one value flows on
    (module docstring).  ValueError names the (sub)module that cannot be split and why; TypeError
    for a Hugging Face causal LM (rp.hf.wrap) or a non-module."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share={max_share!r} must be in (0, 1]")
    instead = "pass a list of layers (or an nn.Sequential) instead, each taking the previous one's output"
    if _is_hf_causal_lm(module):
        raise TypeError(f"{type(module).__name__} is a Hugging Face causal LM: wrap it with rp.hf.wrap(model) "
                        "(docs/hf.md), which cuts it into embedding, decoder layers and head and computes HF's loss")
    if not any(True for _ in module.children()):
        return SplitModule(module, [module])   # nothing to cut: one layer
    try:
        graph = _trace(module, frozenset())
    except _Untraceable as e:
        raise ValueError(f"RoundPipe could not split {_describe(module, '')} into layers: {e}; {instead}") from e
    cuts = _Cuts(graph)
    segs = _segments(module, cuts)   # one piece (`return self.body(x)`): split inside its heaviest child below
    total = _numel(list({id(p): p for p in module.parameters()}.values()))
    limit = max_share * total
    budget = layer_budget(device_memory, compute_dtype)
    if budget is not None:
        limit = min(limit, budget)
    expand, whole = frozenset(), set()
    while True:
        big = [nodes for nodes, _ in segs if _numel(_params(module, nodes)) > limit]
        candidates = {n.target for nodes in big for n in nodes
                      if n.op == "call_module" and n.target not in whole
                      and any(True for _ in module.get_submodule(n.target).children())}
        if not candidates:
            break
        target = max(sorted(candidates), key=lambda t: _numel(list(module.get_submodule(t).parameters())))
        try:
            deeper = _trace(module, expand | {target})
        except _Untraceable as e:
            warnings.warn(f"RoundPipe keeps {_describe(module.get_submodule(target), target)} whole as one layer "
                          f"although it holds more than its share of the parameters: {e}", stacklevel=2)
            whole.add(target)
            continue
        finer = _segments(module, _Cuts(deeper))
        whole.add(target)   # traced through, or (no cut inside: a residual block) kept whole: never again
        if len(finer) > len(segs):
            expand, graph, segs = expand | {target}, deeper, finer
    if len(segs) == 1:
        raise ValueError(f"RoundPipe could not split {_describe(module, '')} into layers: there is no point in its "
                         f"forward, or inside its heaviest children, where a single value flows on "
                         f"({cuts.narrowest()}); {instead}")
    return SplitModule(module, _build(module, graph, segs), _unset_args(module))
