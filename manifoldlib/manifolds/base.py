"""Shared machinery of manifoldlib's manifolds: a geoopt manifold that carries a retraction.

:class:`RetractionManifold` subclasses :class:`geoopt.manifolds.Manifold`, so
``geoopt.ManifoldParameter`` and ``geoopt.optim.RiemannianAdam`` / ``RiemannianSGD`` work on
every manifold here. Its ``retr`` is the retraction chosen at construction (by registry name or
instance); ``with_retraction`` returns a new manifold with the same geometry.

Tolerances of the checks follow the input's dtype (from :func:`torch.finfo`, so bfloat16 and
float16 work as well as float32/float64): ``max(1e-5, 16 * eps)`` unless given.

Input checks come in two kinds. *Type checks* (a real floating dtype, a shape the manifold holds,
the arguments of one method sharing a point shape and batch dimensions that broadcast) read no
values and always run. *Value checks* read the tensors — a sphere point's norm, a retraction's
result being finite — and cost a reduction and a host synchronization per call; a failed one
explains itself (which argument, which row, which value). Inside
:func:`skip_value_checks` they are skipped, for a hot loop whose inputs are valid by
construction; the retraction objects (``manifold.retraction``) and the kernels of
:mod:`manifoldlib.functional` never check.

Mixed dtypes promote, as torch's arithmetic does: a method given tensors of several dtypes
(a float32 ``x`` with a float64 ``u``) computes in :func:`torch.promote_types` of all of them and
returns that dtype (float64 here; float16 with bfloat16 gives float32) — every method of every
manifold, points included (``retr``, ``expmap``), and the built-in retraction objects alike. A
method of one tensor (``projx``) keeps its dtype. The checks of a point judge it at the
tolerance of its own dtype (a float16 point is not refused because its step is float32).
:doc:`/theory/retractions` (*Arguments: dtypes and batches*) gives the reasons.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from collections.abc import Iterator
from typing import Optional, Tuple, Union

import geoopt
import torch

from ..retractions.base import Retraction, resolve_retraction

__all__ = [
    "RetractionManifold",
    "check_finite_result",
    "check_tensor",
    "default_tolerance",
    "max_abs",
    "skip_value_checks",
    "value_checks_enabled",
]


def check_tensor(t: torch.Tensor, name: str, where: str, *, finite: bool = False) -> None:
    """The one input check of every manifold method: ``t`` must be a real floating-point tensor
    (integer, boolean and complex tensors give wrong results silently) and, with ``finite``,
    hold no nan or inf (which would otherwise surface as a misleading ``LinAlgError``).

    ``finite`` costs a reduction (and a device sync), so it is used where a method is rare
    (``projx``) or has already failed (``retr``), not on every step; it is a value check,
    skipped inside :func:`skip_value_checks`.

    Raises:
        ValueError: naming ``where`` (``"stiefel.projx"``), the argument and the bad dtype or
            the count of non-finite entries.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{where}: '{name}' must be a real floating-point tensor (float16, "
                         f"bfloat16, float32, float64), got dtype {t.dtype}")
    if finite and t.device.type != "meta" and value_checks_enabled():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{where}: '{name}' holds {bad} non-finite value(s) (nan or inf); "
                             f"a manifold point or step must be finite")


_VALUE_CHECKS = contextvars.ContextVar("manifoldlib_value_checks", default=True)


@contextlib.contextmanager
def skip_value_checks() -> Iterator[None]:
    """Skip the manifolds' value checks inside the block (the type checks still run).

    The value checks read tensor values — whether a sphere point has the sphere's norm, whether
    a retraction returned finite values — at the cost of a reduction and a host synchronization
    per call. A hot loop whose inputs are valid by construction (points that came out of
    ``retr``, finite gradients) can skip them:

    .. code-block:: python

        with skip_value_checks():
            for _ in range(steps):
                loss(param).backward()
                optimizer.step()

    Inside the block bad input is no longer named in an error: it gives wrong values.
    The setting is per thread (and per asyncio task) and restored on exit.
    """
    token = _VALUE_CHECKS.set(False)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Whether the value checks run here (``False`` inside :func:`skip_value_checks`)."""
    return _VALUE_CHECKS.get()


def check_finite_result(y: torch.Tensor, where: str, **inputs: torch.Tensor) -> torch.Tensor:
    """Return ``y`` when it and every input are finite (or the value checks are off); otherwise
    raise ``ValueError`` naming the first non-finite input or, when every input is finite, the
    size of the inputs (a step too long for the dtype).

    The inputs are checked as well as the result: a decomposition of a non-finite matrix may
    return finite garbage (an SVD with an inf entry gives a zero polar factor).
    """
    if not value_checks_enabled() or y.device.type == "meta":
        return y
    finite = torch.isfinite(y).all()
    for t in inputs.values():
        finite = finite & torch.isfinite(t).all()
    if bool(finite):  # one host synchronization
        return y
    for name, t in inputs.items():
        check_tensor(t, name, where, finite=True)
    sizes = ", ".join(f"max |{name}| = {float(max_abs(t.detach())):.3g}" for name, t in inputs.items())
    raise ValueError(f"{where}: the result has non-finite values although every input is finite "
                     f"({sizes}): the step is too long for {y.dtype}")


def max_abs(t: torch.Tensor) -> torch.Tensor:
    """The largest ``|entry|`` of ``t``, a 0-dim tensor; 0 for an empty tensor (a batch of no
    points, where ``amax`` raises)."""
    return t.abs().amax() if t.numel() else t.new_zeros(())


def default_tolerance(dtype: torch.dtype) -> float:
    """Check tolerance for a dtype: ``max(1e-5, 16 * eps(dtype))``."""
    if not dtype.is_floating_point:
        return 1e-5
    return max(1e-5, 16.0 * float(torch.finfo(dtype).eps))


class RetractionManifold(geoopt.manifolds.Manifold):
    """A geoopt manifold whose ``retr`` is a pluggable :class:`~manifoldlib.retractions.Retraction`.

    Subclasses set ``name`` (the retraction registry they draw from), ``ndim`` and
    ``default_retraction``, and implement the geometry.
    """

    default_retraction: str = ""
    reversible = False

    def __init__(self, retraction: Union[str, Retraction, None] = None, **retraction_options):
        super().__init__()
        chosen = self.default_retraction if retraction is None else retraction
        self._retraction = resolve_retraction(self.name, chosen, **retraction_options)

    # -- retraction plumbing ------------------------------------------------------------
    @property
    def retraction(self) -> Retraction:
        """The retraction used by :meth:`retr`."""
        return self._retraction

    def _init_kwargs(self) -> dict:
        """Geometry keyword arguments (everything but the retraction), for :meth:`with_retraction`."""
        return {}

    def with_retraction(self, retraction: Union[str, Retraction], **options) -> "RetractionManifold":
        """A new manifold with the same geometry and another retraction."""
        return type(self)(**self._init_kwargs(), retraction=retraction, **options)

    def retr(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Retraction :math:`R_x(u)` with the chosen retraction.

        A retraction whose formula assumes ``x`` on the manifold
        (:attr:`~manifoldlib.retractions.Retraction.needs_point`: Stiefel's ``exp`` and ``cayley``)
        is given only points within the dtype's default tolerances; a projection of ``x + u``
        (``polar``, ``qr``, ``normalize``, DGram's) maps any ``x``, as geoopt's retractions do.

        Raises:
            ValueError: naming a non-finite ``x`` or ``u``, a step too long for the dtype, an
                ``x`` off the manifold for a retraction that needs a point, or a step the
                retraction has no point for (:meth:`_step_refusal`: Oblique's and DGram's zero
                columns of ``x + u``) (value checks, see :func:`skip_value_checks`).
        """
        where = f"{self.name}.retr"
        dtype = self._validate_args(where, x=x, u=u)
        if self._retraction.needs_point:
            self._require_point(x, where, f"the {self._retraction!r} retraction (not a projection of x + u)")
        try:
            y = self._retraction.retract(x.to(dtype), u.to(dtype))
        except (torch.linalg.LinAlgError, ValueError):  # nan/inf inputs fail inside a decomposition: say so
            self._explain_failed_step(x, u, where)
            raise
        try:
            return check_finite_result(y, where, x=x, u=u)
        except ValueError:
            self._explain_failed_step(x, u, where)
            raise

    def _explain_failed_step(self, x: torch.Tensor, u: torch.Tensor, where: str) -> None:
        """After :meth:`retr`'s retraction failed or returned non-finite values: raise
        ``ValueError`` naming a non-finite ``x`` or ``u``, else the manifold's
        :meth:`_step_refusal`; return when neither applies (the caller re-raises)."""
        if not value_checks_enabled():
            return
        check_tensor(x, "x", where, finite=True)
        check_tensor(u, "u", where, finite=True)
        reason = self._step_refusal(x.detach(), u.detach())
        if reason is not None:
            raise ValueError(f"{where}: {reason}")

    def _step_refusal(self, x: torch.Tensor, u: torch.Tensor) -> str | None:
        """Why the retraction has no point for the finite step ``u`` at ``x`` (``None``: no reason
        known); asked only after it failed, so it may cost a pass."""
        return None

    def retr_transp(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`retr` of ``u`` and :meth:`transp` of ``v`` to the new point."""
        return self._step_and_transp("retr_transp", self.retr, x, u, v)

    def transp_follow_retr(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`transp` of ``v`` to ``retr(x, u)``."""
        return self._step_and_transp("transp_follow_retr", self.retr, x, u, v)[1]

    def expmap_transp(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`expmap` of ``u`` and :meth:`transp` of ``v`` to the new point."""
        return self._step_and_transp("expmap_transp", self.expmap, x, u, v)

    def transp_follow_expmap(self, x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`transp` of ``v`` to ``expmap(x, u)``."""
        return self._step_and_transp("transp_follow_expmap", self.expmap, x, u, v)[1]

    def _step_and_transp(self, method: str, step, x, u, v) -> tuple[torch.Tensor, torch.Tensor]:
        """``y = step(x, u)`` and ``v`` transported to it, both in the dtype of ``x``, ``u`` and
        ``v`` promoted, the three checked as one batch first (``method`` names the caller)."""
        dtype = self._validate_args(f"{self.name}.{method}", x=x, u=u, v=v)
        y = step(x, u.to(dtype))  # u in the common dtype: y has it (x is checked in its own)
        return y, self.transp(x, y, v)

    def transp(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Vector transport by projection onto the tangent space at ``y``."""
        dtype = self._validate_args(f"{self.name}.transp", x=x, y=y, v=v)
        return self.proju(y.to(dtype), v.to(dtype))

    def egrad2rgrad(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Riemannian gradient of the embedded (Euclidean) metric: the tangent projection."""
        self._validate_args(f"{self.name}.egrad2rgrad", x=x, u=u)
        return self.proju(x, u)

    def inner(
        self, x: torch.Tensor, u: torch.Tensor, v: Optional[torch.Tensor] = None, *, keepdim: bool = False
    ) -> torch.Tensor:
        r"""The embedded (Euclidean) metric :math:`\langle u, v\rangle`, summed over the ``ndim``
        point dimensions: one value per point of the batch that ``x``, ``u`` and ``v`` broadcast to
        (geoopt's convention), so ``inner(x, u)`` with ``x`` ``(3, d)`` and ``u`` ``(d,)`` is the
        inner product at each of the three points, shape ``(3,)``, not one value ``()``.
        ``keepdim`` keeps the point dimensions as size 1."""
        vectors = {"u": u} if v is None else {"u": u, "v": v}
        dtype = self._validate_args(f"{self.name}.inner", x=x, **vectors)
        u = u.to(dtype)
        v = u if v is None else v.to(dtype)
        prod = u * v
        ndim = getattr(self, "ndim", 0)
        if not ndim:
            return prod.expand(torch.broadcast_shapes(x.shape, prod.shape))
        prod = prod.sum(dim=tuple(range(-ndim, 0)), keepdim=keepdim)
        batch = tuple(x.shape[: max(x.dim() - ndim, 0)]) + (1,) * (ndim * keepdim)
        return prod.expand(torch.broadcast_shapes(batch, prod.shape))

    def norm(self, x: torch.Tensor, u: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
        r""":math:`\|u\| = \langle u, u\rangle^{1/2}`, one value per point as :meth:`inner`.

        At :math:`u = 0`, where the norm is not differentiable, its gradient is 0, the subgradient
        :func:`torch.linalg.vector_norm` takes; geoopt's ``inner ** 0.5`` gave NaN there (the
        infinite derivative of the square root at 0 times the zero gradient of ``inner``)."""
        sq = self.inner(x, u, keepdim=keepdim)
        zero = sq == 0
        # double-where: the square root never sees the zeros, so its infinite derivative is not formed
        return torch.where(zero, torch.zeros_like(sq), torch.where(zero, torch.ones_like(sq), sq) ** 0.5)

    # -- validation ---------------------------------------------------------------------
    #: The retractions of this manifold that map any ``x + u`` (named where a map that needs a
    #: point refuses one).
    projection_retractions: Tuple[str, ...] = ()

    def _require_point(self, x: torch.Tensor, where: str, what: str) -> None:
        """Raise ``ValueError`` when ``x`` is not a point of the manifold within the default
        tolerances of its dtype (:meth:`check_point_on_manifold`), for ``what``, a map whose formula
        assumes one (``"the exponential map"``): a value check, skipped inside
        :func:`skip_value_checks`; one host synchronization (:meth:`_point_refusal`)."""
        if not value_checks_enabled() or x.device.type == "meta":
            return
        within, reason = self._point_refusal(x.detach())
        if reason is None:
            return
        if not within:
            check_tensor(x, "x", where, finite=True)
            reason = f"{reason} (the default tolerances for {x.dtype})"
        instead = ", ".join(repr(name) for name in self.projection_retractions)
        raise ValueError(
            f"{where}: 'x' is not a point of {type(self).__name__}: {reason}; {what} assumes one: "
            f"project x first ({type(self).__name__}.projx)"
            + (f", or use a retraction that maps any x + u ({instead})" if instead else "")
        )

    def _point_refusal(self, x: torch.Tensor) -> Tuple[bool, Optional[str]]:
        """Why :meth:`_require_point` refuses ``x`` (``None``: it takes it), with whether ``x`` is
        within its dtype's default tolerances (:meth:`check_point_on_manifold`): ``(False, reason)``
        when it is not; Stiefel's also gives ``(True, reason)`` for a point within them that is
        still too far off for the maps that repair its rounding before they use it."""
        return self.check_point_on_manifold(x, explain=True)

    def _validate(self, x: torch.Tensor, name: str) -> None:
        """Raise ``ValueError`` when ``x`` is not a real floating-point tensor or has a shape the
        manifold cannot hold."""
        check_tensor(x, name, self.name)
        ok, reason = self._check_shape(tuple(x.shape), name)
        if not ok:
            raise ValueError(reason)

    #: Argument names of :meth:`_validate_args` that are points (the others are vectors); ``w`` is
    #: the point of the matrix manifolds' dual helpers.
    _POINT_ARGS = ("x", "y", "w")

    def _validate_args(self, where: str, **tensors: torch.Tensor) -> torch.dtype:
        """The type checks of a method of several tensors (``x=x, u=u``, named as its arguments);
        returns the dtype it computes in and returns, :func:`torch.promote_types` of them all.

        Each must be a real floating-point tensor; a point (``x``, ``y``) must have a shape the
        manifold holds (:meth:`_validate`); every tensor must have the point shape of the first;
        and their leading batch dimensions must broadcast together (``x`` ``(2, d)`` with ``u``
        ``(3, d)`` is no batch: torch's ``RuntimeError`` came from deep inside, or a check
        returned ``True`` for it).

        Raises:
            ValueError: naming ``where``, the argument and its shape or dtype; for batches that
                do not broadcast, every argument's shape.
        """
        for name, t in tensors.items():
            if name in self._POINT_ARGS:
                self._validate(t, name)
            else:
                check_tensor(t, name, where)
        reason = self._shapes_problem(where, tensors)
        if reason is not None:
            raise ValueError(reason)
        return functools.reduce(torch.promote_types, (t.dtype for t in tensors.values()))

    def _shapes_problem(self, where: str, tensors: dict) -> str | None:
        """Why ``tensors`` (name -> tensor, the first a point) are not one batch of the manifold's
        shape: a point shape other than the first's, or batch dimensions that do not broadcast;
        ``None`` when they are."""
        ndim = getattr(self, "ndim", 0)
        (first, x), *others = tensors.items()
        if x.dim() < ndim:
            return (f"{where}: '{first}' on {self.name} needs at least {ndim} dimension(s), the "
                    f"point's, got shape {tuple(x.shape)}")
        point = tuple(x.shape[x.dim() - ndim:])
        for name, t in others:
            if t.dim() < ndim or tuple(t.shape[t.dim() - ndim:]) != point:
                return (f"{where}: '{name}' must have the point shape {point} of {first} on "
                        f"{self.name}, got shape {tuple(t.shape)}")
        batches = [tuple(t.shape[: t.dim() - ndim]) for t in tensors.values()]
        try:
            torch.broadcast_shapes(*batches)
        except RuntimeError:
            shapes = [f"{name} of shape {tuple(t.shape)}" for name, t in tensors.items()]
            leading = [str(b) for b in batches]
            return (f"{where}: {', '.join(shapes[:-1])} and {shapes[-1]} are not one batch: their "
                    f"batch dimensions {', '.join(leading[:-1])} and {leading[-1]} (before the point "
                    f"shape {point}) do not broadcast (each dimension equal or 1, aligned from the right)")
        return None

    def check_point_on_manifold(
        self, x: torch.Tensor, *, explain: bool = False, atol: Optional[float] = None, rtol: Optional[float] = None
    ) -> Union[Tuple[bool, Optional[str]], bool]:
        """geoopt's check with dtype-aware default tolerances; ``explain=True`` returns ``(ok, reason)``."""
        tol = default_tolerance(x.dtype)
        return super().check_point_on_manifold(
            x, explain=explain, atol=tol if atol is None else atol, rtol=tol if rtol is None else rtol
        )

    def assert_check_point_on_manifold(
        self, x: torch.Tensor, *, atol: Optional[float] = None, rtol: Optional[float] = None
    ) -> None:
        """:meth:`check_point_on_manifold`'s twin, with its tolerances: ``ValueError(reason)``."""
        tol = default_tolerance(x.dtype)
        super().assert_check_point_on_manifold(
            x, atol=tol if atol is None else atol, rtol=tol if rtol is None else rtol
        )

    def check_vector_on_tangent(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        *,
        ok_point: bool = False,
        explain: bool = False,
        atol: Optional[float] = None,
        rtol: Optional[float] = None,
    ) -> Union[Tuple[bool, Optional[str]], bool]:
        """geoopt's check with dtype-aware default tolerances; ``explain=True`` returns ``(ok, reason)``.

        By default ``x`` is judged as a point at its own dtype's tolerances
        (:meth:`check_point_on_manifold`; skipped with ``ok_point``), and ``u``'s tangency at the
        looser of ``x``'s and ``u``'s: the rounding of either is in :math:`x^\top u` (a float16 point
        with a float64 ``u`` was judged at float64's, and refused for its own rounding). Given
        ``atol`` / ``rtol`` apply to both, as in geoopt. A ``u`` of another point shape than
        ``x``, or batches that do not broadcast, fail it (:meth:`_validate_args`'s reason)."""
        reason = self._shapes_problem(f"{self.name}.check_vector_on_tangent", {"x": x, "u": u})
        ok, reason = (False, reason) if reason is not None else self._tangent_check(x, u, ok_point, atol, rtol)
        return (ok, reason) if explain else ok

    def assert_check_vector_on_tangent(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        *,
        ok_point: bool = False,
        atol: Optional[float] = None,
        rtol: Optional[float] = None,
    ) -> None:
        """:meth:`check_vector_on_tangent`'s twin, with its tolerances: ``ValueError(reason)``."""
        reason = self._shapes_problem(f"{self.name}.assert_check_vector_on_tangent", {"x": x, "u": u})
        if reason is not None:
            raise ValueError(reason)
        ok, reason = self._tangent_check(x, u, ok_point, atol, rtol)
        if not ok:  # geoopt's message
            raise ValueError(f"`u` seems to be a tensor not lying on tangent space to `x` for {self.name} "
                             f"manifold.\nerror: {reason}")

    def _tangent_check(self, x, u, ok_point: bool, atol, rtol) -> Tuple[bool, Optional[str]]:
        """``(ok, reason)`` of :meth:`check_vector_on_tangent` for ``x`` and ``u`` of one batch."""
        if not ok_point:
            ok, reason = self.check_point_on_manifold(x, explain=True, atol=atol, rtol=rtol)
            if not ok:
                return ok, reason
        tol = max(default_tolerance(x.dtype), default_tolerance(u.dtype))
        return self._check_vector_on_tangent(x, u, atol=tol if atol is None else atol, rtol=tol if rtol is None else rtol)

    def extra_repr(self) -> str:
        return f"retraction={self._retraction!r}"


#: The dtypes ``random()`` draws points in.
_POINT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _random_normal(shape, generator, dtype, device) -> torch.Tensor:
    """A standard normal ``shape`` tensor to build points of ``dtype`` from (float32 for the
    16-bit dtypes), and ``dtype`` (the default dtype for ``None``).

    Raises:
        ValueError: ``dtype`` is not a real floating-point dtype (an integer or boolean one
            raised torch's ``NotImplementedError``, a complex one gave complex "points").
    """
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if dtype not in _POINT_DTYPES:
        raise ValueError(f"random() dtype must be a real floating-point dtype (float16, bfloat16, "
                         f"float32, float64), got {dtype!r}")
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return torch.randn(shape, generator=generator, dtype=work, device=device), dtype


def _size_tuple(size) -> tuple[int, ...]:
    """The shape given to ``random(*size)`` (or ``random(shape)``); each entry an int ``>= 0``
    (Python, NumPy or torch ints, not bools), never truncated or parsed."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    shape = []
    for s in size:
        try:
            dim = operator.index(s) if not isinstance(s, bool) else None
        except TypeError:
            dim = None
        if dim is None or dim < 0:
            raise ValueError(f"random() sizes must be ints >= 0, got {s!r} in {tuple(size)!r}")
        shape.append(dim)
    return tuple(shape)
