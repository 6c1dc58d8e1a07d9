"""ZeRO's rows layout (``zero:1``, ``zero:2``): every parameter tensor cut into N pieces of
rows, rank r stepping rows ``[r * c, r * c + c)`` of each (``c = ceil(rows / N)``, FSDP2's
dim-0 split), in place of whole tensors owned by one rank each (``zero_shards.OwnerLayout``).

Why (issue 47): with whole tensors a rank's share of the optimizer state is as uneven as the
tensors' sizes (6 weights of 64 MiB on 4 ranks: two ranks own two, a third of AdamW's state
where a quarter is even; a model whose one tensor holds 95% of the bytes puts 95% of the state
on one rank, and sharding saves nothing), the optimizer's temporaries in its step are a whole
tensor's, and a ``zero:2`` round, which carries the same slice of every owner's chunk, waits for
one whole gradient per owner. By rows every rank holds 1/N of every tensor's state, to within
a row, steps a piece of each, and a round carries consecutive tensors, ready as soon as
backward has made them.

Only for optimizers whose update is element by element (``ELEMENTWISE``: torch's SGD, Adam,
AdamW and their kin, by exact class): their step on a piece of rows is, element for element,
their step on the whole tensor, so ``zero:1`` ends bitwise where whole tensors would leave it
(``zero:2`` too on 2 ranks; on more, its reduce-scatter sums each element starting from a rank
that depends on the element's owner, so the layouts differ in rounding). A rule over a whole
tensor (Adafactor's factored moments, LAMB's or LARS's trust ratio, a subclass or an optimizer
of the user's own, which gradsync cannot read) would be taken over each rank's rows instead:
those keep whole tensors (``choose_layout`` says which applies), as do models with a
non-contiguous parameter (channels_last). 0-dim tensors are whole units of rank 0's: under
``zero:2`` only rank 0 steps them; under ``zero:1`` every rank does (each holds the same mean
gradient and state) and rank 0's result is gathered. Fused optimizers compute by chunks of
their own, so a piece's step can differ from the whole tensor's in rounding (seen at 3e-17 with
fused AdamW on CPU); the bitwise claims hold for the others.

How the user's optimizer steps pieces: each rank's piece of a parameter is a tensor that
shares the parameter's storage (``p.detach()[a:b]``: a leaf, which the step updates in place,
and the parameter with it). While gradsync steps the optimizer or reads or loads its state
(its state-dict hooks), and under ``zero:2`` from the gradient-ready point to the update, the
optimizer's param groups hold this rank's pieces in place of the parameters; the rest of the
time they hold the parameters, so the user's code sees the optimizer it built. The pieces'
``.grad``: under ``zero:1`` this rank's rows of the whole mean gradient that ``p.grad`` holds
(views, given for the step only, so a GradScaler's ``unscale_`` acts on the whole gradient, as
under ``bsp``); under ``zero:2`` this rank's rows of the mean gradient, the only copy (the
scaler's ``unscale_(optimizer)`` acts on them, and the ranks agree on its verdict in the
update). The optimizer's state is that of this rank's pieces; ``optimizer.state_dict()`` keeps
the whole tensors' indices, each entry holding this rank's rows (``gradsync.row_shards`` joins
and splits them), and a whole state loaded by the user's code (a DDP script's checkpoint) is
cut into this rank's rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from gradsync.errors import UsageError
from gradsync.logs import get_logger
from gradsync.row_shards import ROWS, WHOLE, rows_of, split
from gradsync.row_shards import join as join_rows
from gradsync.strategies.base import reading_own_state
from gradsync.strategies.zero_shards import FlatGroup, OwnerLayout

logger = get_logger("strategies.zero")

#: optimizers whose step is element by element (by exact class: a subclass may add a rule
#: over the whole tensor)
ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)
#: the layouts ``zero:1`` takes (``ZeroStage1(layout=...)``); "auto": rows where they apply
LAYOUTS = ("auto", ROWS, WHOLE)


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


def why_not_rows(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    names: Mapping[int, str] | None = None,
) -> str | None:
    """Why the rows layout cannot hold this optimizer's step or these parameters (None: it
    can). ``names``: each parameter's name in the model by ``id``, to name the one refused."""
    if type(optimizer) not in ELEMENTWISE:
        valid = ", ".join(sorted(c.__name__ for c in ELEMENTWISE))
        return (
            f"its optimizer, {type(optimizer).__name__}, is not one whose update is element by "
            f"element ({valid})"
        )
    for p in params:
        if p.dim() and not p.is_contiguous():  # channels_last, a transposed view
            name, shape = (names or {}).get(id(p)), tuple(p.shape)
            it = f"parameter {name!r} (shape {shape})" if name else f"a parameter of shape {shape}"
            return (
                f"{it} is not contiguous (a piece of rows is a view of one): its memory "
                "format is channels_last or it is a transposed view"
            )
    return None


def choose_layout(
    requested: str,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    world: int,
    name: str,
    names: Mapping[int, str] | None = None,
) -> str:
    """The layout a stage runs: ``requested``, or for "auto" rows where they apply (and there
    is more than one rank to cut for)."""
    if requested == WHOLE or (requested == "auto" and world == 1):
        return WHOLE
    reason = why_not_rows(optimizer, params, names)
    if reason is None:
        if requested == "auto":  # said as bsp says its bucket plan: which one ran
            logger.info("%s: layout auto: rows (each rank steps its rows of every tensor)", name)
        return ROWS
    if requested == ROWS:
        raise UsageError(
            f"{name} cannot shard by rows here: {reason}. Use layout='whole' (or 'auto', which "
            "picks whole tensors then)"
        )
    logger.info("%s: layout auto: whole tensors, dealt to the ranks by size (%s)", name, reason)
    return WHOLE


class RowLayout:
    """Each trainable tensor of one or more dimensions cut into ``world`` pieces of rows,
    piece r owned by rank r; the same interface as ``OwnerLayout`` (the units its flat groups
    hold are the pieces), and it puts this rank's pieces into the optimizer (``install``)."""

    kind = ROWS

    def __init__(self, params: Sequence[torch.Tensor], world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        #: the parameters cut into rows; 0-dim ones (``scalars``) stay whole, owned by rank 0
        self.cut = [p for p in params if p.dim() > 0 and p.numel() > 0]
        #: every parameter the layout carries, in the model's order
        self.reals = [p for p in params if p.numel() > 0]
        #: per cut parameter, every rank's piece (views of the parameter)
        self.pieces = [
            [p.detach()[slice(*rows_of(p.shape, world, r))] for r in range(world)] for p in self.cut
        ]
        # A scalar is its own unit on rank 0; the others hold an empty one in its slot.
        cut_pieces = {id(p): pieces for p, pieces in zip(self.cut, self.pieces, strict=True)}
        units = [
            cut_pieces[id(p)]
            if p.dim()
            else [p, *(p.detach().reshape(1)[1:1] for _ in range(1, world))]
            for p in self.reals
        ]
        #: per unit (by id): the parameter it is part of, and its rows (None: all of it)
        self._source: dict[int, tuple[torch.Tensor, tuple[int, int] | None]] = {}
        for p, parts in zip(self.reals, units, strict=True):
            for r, unit in enumerate(parts):
                rows = rows_of(p.shape, world, r) if p.dim() else None
                self._source[id(unit)] = (p, rows)
        self.params: list[torch.Tensor] = []
        self.owners: list[int] = []
        for parts in units:
            for r, unit in enumerate(parts):
                self.params.append(unit)
                self.owners.append(r)
        self.mine = [parts[rank] for parts in units]
        self.others = [u for parts in units for r, u in enumerate(parts) if r != rank]
        self.groups = _row_groups(self.reals, units, world)
        #: each cut parameter and this rank's piece of it, and both ways by id
        self._pairs = [(p, pieces[rank]) for p, pieces in zip(self.cut, self.pieces, strict=True)]
        self._piece_of = {id(p): piece for p, piece in self._pairs}
        self._param_of = {id(piece): p for p, piece in self._pairs}
        #: this rank's unit of each parameter it holds part of, by the parameter's id and by
        #: the unit's own (``part``)
        self._part: dict[int, torch.Tensor] = {}
        for unit in self.mine:
            if unit.numel():
                self._part[id(self._source[id(unit)][0])] = self._part[id(unit)] = unit
        #: per optimizer index: the shape of the whole tensor it steps rows of (None: whole)
        self.shapes: list[list[int] | None] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._hooks: list[Any] = []

    def source(self, unit: torch.Tensor) -> torch.Tensor:
        """The parameter ``unit`` is part of."""
        return self._source[id(unit)][0]

    def gradient_of(self, unit: torch.Tensor) -> torch.Tensor | None:
        """``unit``'s rows of its parameter's gradient (a view; None: no gradient yet)."""
        p, rows = self._source[id(unit)]
        if p.grad is None:
            return None
        return p.grad if rows is None else p.grad[rows[0] : rows[1]]

    def part(self, p: torch.Tensor) -> torch.Tensor | None:
        """This rank's unit of parameter ``p`` (its rows; a scalar's on rank 0 only); a unit
        of this rank's is its own part."""
        return self._part.get(id(p))

    def join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The whole optimizer state dict from every rank's rows (``full_state_dict``)."""
        return join_rows(parts, self.shapes)

    def part_of(self, whole: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's rows of a whole optimizer state dict."""
        return split(whole, self.shapes, self.world, self.rank)

    def check(self, updated: Sequence[torch.Tensor], name: str) -> None:
        """Every rank steps its rows of whatever the optimizer updates: nothing to refuse."""

    def numel(self, rank: int) -> int:
        return sum(u.numel() for u, o in zip(self.params, self.owners, strict=True) if o == rank)

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` step this rank's pieces: any state it already holds for the cut
        parameters cut alike (a script that loaded a checkpoint before building the
        Synchronizer), and its state dict read and loaded through the pieces."""
        self._optimizer = optimizer
        self.shapes = [
            list(p.shape) if id(p) in self._piece_of else None for p in _params_of(optimizer)
        ]
        held = optimizer.state
        whole = {i: held[p] for i, p in enumerate(_params_of(optimizer)) if p in held}
        cut = split({"state": whole}, self.shapes, self.world, self.rank)["state"]
        for i, p in enumerate(_params_of(optimizer)):
            if id(p) in self._piece_of and p in held:
                del held[p]
                held[self._piece_of[id(p)]] = cut[i]
        self._hooks = [
            optimizer.register_state_dict_pre_hook(self._before_state_dict),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]

    def show(self, pieces: bool) -> None:
        """Put this rank's pieces (or the whole parameters back) in the optimizer's param
        groups: the pieces while gradsync steps it or reads or loads its state, the
        parameters the rest of the time, so that the user's code (a GradScaler's unscale, a
        scheduler, ``zero_grad``) sees the optimizer it built."""
        assert self._optimizer is not None, "install() has not run"
        to = self._piece_of if pieces else self._param_of
        for group in self._optimizer.param_groups:
            group["params"] = [to.get(id(p), p) for p in group["params"]]

    def _before_state_dict(self, _: torch.optim.Optimizer) -> None:
        # Only gradsync's own reads: the user's are refused (``refuse_partial_state``), by a
        # hook after this one, which would leave the pieces in place.
        if reading_own_state():
            self.show(pieces=True)

    def _after_state_dict(self, _: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.show(pieces=False)

    def _before_load(self, _: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """A whole state (a DDP script's checkpoint, loaded by the user's code) is cut into
        this rank's rows first. torch loads it under the parameters (the param groups are
        left alone, so a load that fails leaves the optimizer as it was); ``_after_load``
        keys it by the pieces."""
        self.show(pieces=False)
        if self._is_whole(state):
            return split(state, self.shapes, self.world, self.rank)
        return state

    def _after_load(self, optimizer: torch.optim.Optimizer) -> None:
        held = optimizer.state
        for p, piece in self._pairs:
            if p in held:
                held[piece] = held.pop(p)

    def check_storage(self) -> None:
        """``UsageError`` unless every piece is still a view of its parameter: a parameter
        given new storage after the Synchronizer was built (``model.to(memory_format=...)``,
        ``p.data = ...``) would silently stop training, the optimizer stepping the old one."""
        for p, piece in self._pairs:
            if piece.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                raise UsageError(
                    f"a parameter of shape {tuple(p.shape)} was given new storage after the "
                    "Synchronizer was built (model.to(...) with another memory format or "
                    "dtype, p.data = ...): its rows, which the optimizer steps, are views of "
                    "the old one. Convert the model before building the Synchronizer"
                )

    def _is_whole(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` holds whole tensors' entries rather than this rank's rows (told
        by the first entry whose rows differ between the two)."""
        for index, entry in state.get("state", {}).items():
            shape = self.shapes[int(index)] if int(index) < len(self.shapes) else None
            if shape is None:
                continue
            start, stop = rows_of(shape, self.world, self.rank)
            if stop - start == shape[0]:
                continue  # this rank's rows are the whole tensor: either reads alike
            for value in entry.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    return int(value.shape[0]) == shape[0]
        return False

    @contextmanager
    def grads_for_step(self, full_grads: bool) -> Iterator[None]:
        """For the step, the optimizer holds this rank's pieces. ``full_grads`` (``zero:1``,
        whose parameters hold the whole mean gradient): each piece is given its rows of it (a
        view: nothing is copied) for the step only; else (``zero:2``) the pieces hold this
        rank's rows of the mean gradient already. After the step, the parameters again."""
        self.check_storage()
        given = []
        if full_grads:
            for _, piece in self._pairs:
                piece.grad = self.gradient_of(piece)
                if piece.grad is not None:
                    given.append(piece)
        self.show(pieces=True)
        try:
            yield
        finally:
            self.show(pieces=False)
            for piece in given:
                piece.grad = None

    def close(self) -> None:
        """Leave the optimizer with the user's parameters in its param groups and its state
        keyed by them again: each entry this rank's rows (a piece's shape), as whole tensors
        leave each rank the state of its own tensors only. Inspectable, and its
        ``state_dict()`` works; a plain ``optimizer.step()`` after it fails on the shapes
        (loudly, where dropping the state would restart the moments silently):
        ``sync.full_state_dict()`` before ``close`` gives the whole state."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._optimizer is None:
            return
        self.show(pieces=False)
        held = self._optimizer.state
        for p, piece in self._pairs:
            if piece in held:
                held[p] = held.pop(piece)

    def state_record(self) -> dict[str, Any]:
        return {"owners": list(self.owners), "layout": ROWS, "shapes": self.shapes}


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _row_groups(
    reals: Sequence[torch.Tensor], pieces: Sequence[Sequence[torch.Tensor]], world: int
) -> list[FlatGroup]:
    """Flat groups (one per dtype and device) whose chunk r holds rank r's piece of every
    tensor, each in a slot of the longest piece's size at the same place in every chunk, the
    tensors from the last registered (the order backward usually finishes them): so a round
    of the chunks carries whole consecutive tensors, ready as soon as backward makes them."""
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for j, p in enumerate(reals):
        kinds.setdefault((p.dtype, p.device), []).append(j)
    groups = []
    for members in kinds.values():
        members.sort(key=lambda j: -j)
        slots, at = [], 0
        for j in members:
            slots.append(at)
            at += pieces[j][0].numel()  # the first piece is the longest
        chunk = at
        units, owners, offsets = [], [], []
        gaps: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        loads = [0] * world
        for r in range(world):
            for j, slot in zip(members, slots, strict=True):
                piece = pieces[j][r]
                units.append(piece)
                owners.append(r)
                offsets.append(r * chunk + slot)
                loads[r] += piece.numel()
                longest = pieces[j][0].numel()
                if piece.numel() < longest:
                    gaps[r].append((slot + piece.numel(), slot + longest))
        groups.append(
            FlatGroup(
                params=tuple(units),
                owners=tuple(owners),
                offsets=tuple(offsets),
                loads=tuple(loads),
                chunk=chunk,
                world=world,
                gaps=tuple(tuple(g) for g in gaps),
            )
        )
    return groups


def make_layout(
    params: Sequence[torch.Tensor],
    world: int,
    rank: int,
    optimizer: torch.optim.Optimizer,
    kind: str,
) -> OwnerLayout | RowLayout:
    """The layout of ``kind`` (``choose_layout``'s answer), rows installed in ``optimizer``."""
    if kind == ROWS:
        layout = RowLayout(params, world, rank)
        layout.install(optimizer)
        return layout
    return OwnerLayout(params, world, rank)
