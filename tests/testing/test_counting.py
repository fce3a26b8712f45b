"""count_ops: which calls count as host synchronizations (what a GPU would wait for)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from manifoldlib.testing import count_ops


def _data():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 4, generator=g, dtype=torch.float64)
    return a, a.T @ a + torch.eye(4, dtype=torch.float64), a > 0


def test_reads_of_values_that_set_an_output_size_or_an_error_count_as_syncs():
    # each reads device values on the host on a GPU: a data-dependent output size (allocated after
    # a read of it), the linalg error check and the eigendecompositions / SVDs torch documents as
    # synchronizations, a list of tensors read element by element into a new tensor
    a, spd, mask = _data()
    counts_of = torch.tensor([1, 0, 2, 1])
    reads = {
        "x[mask]": lambda: a[mask],
        "x[row_mask]": lambda: a[mask[:, 0]],
        "masked_select": lambda: torch.masked_select(a, mask),
        "unique": lambda: torch.unique(a),
        "unique dim": lambda: torch.unique(a, dim=0),
        "unique_consecutive": lambda: torch.unique_consecutive(a),
        "repeat_interleave": lambda: a.repeat_interleave(counts_of, dim=1),
        "bincount": lambda: torch.bincount(counts_of),
        "histc": lambda: torch.histc(a, bins=4),
        "x[mask] += 1": lambda: a.clone().index_put_((mask,), torch.tensor(1.0, dtype=a.dtype), accumulate=True),
        "x[row_mask] = rows": lambda: a.clone().__setitem__(mask[:, 0], torch.zeros(4, dtype=a.dtype)),
        "cholesky": lambda: torch.linalg.cholesky(spd),
        "inv": lambda: torch.linalg.inv(spd),
        "solve": lambda: torch.linalg.solve(spd, a.T),
        "lu_factor": lambda: torch.linalg.lu_factor(spd),
        "eigh": lambda: torch.linalg.eigh(spd),
        "eigvalsh": lambda: torch.linalg.eigvalsh(spd),
        "svd": lambda: torch.linalg.svd(a, full_matrices=False),
        "svdvals": lambda: torch.linalg.svdvals(a),
        "spectral norm": lambda: torch.linalg.matrix_norm(a, ord=2),
        "pinv": lambda: torch.linalg.pinv(a),
        "tensor of a list": lambda: torch.tensor([a.sum(), a.mean()]),
        "as_tensor of a list": lambda: torch.as_tensor([[a.sum()], [a.mean()]]),
    }
    counted = {name: count_ops(read).syncs for name, read in reads.items()}
    assert counted == dict.fromkeys(reads, 1)


def test_their_twins_that_read_nothing_count_none():
    a, spd, mask = _data()
    counts_of = torch.tensor([1, 0, 2, 1])
    tensor, as_tensor = torch.tensor, torch.as_tensor
    quiet = {
        "x[index]": lambda: a[torch.tensor([0, 2])],
        "repeat_interleave with output_size": lambda: a.repeat_interleave(counts_of, dim=1, output_size=4),
        "repeat_interleave by an int": lambda: a.repeat_interleave(2, dim=1),
        "x[mask] = 0": lambda: a.clone().__setitem__(mask, 0.0),  # a masked_fill_
        "histc in a range": lambda: torch.histc(a, bins=4, min=-1, max=1),
        "cholesky_ex": lambda: torch.linalg.cholesky_ex(spd),
        "tensor of numbers": lambda: torch.tensor([1.0, 2.0]),
        "tensor of a tensor": lambda: torch.as_tensor(a, dtype=torch.float32),
        "stack": lambda: torch.stack([a.sum(), a.mean()]),
    }
    counted = {name: count_ops(read).syncs for name, read in quiet.items()}
    assert counted == dict.fromkeys(quiet, 0)
    assert (torch.tensor, torch.as_tensor) == (tensor, as_tensor)  # restored as found


def test_reads_that_only_a_gpu_makes_count_as_syncs_on_the_cpu():
    # what a CUDA device would wait for, though a CPU tensor dispatches nothing that reads: a copy
    # to the host, a documented synchronizing decomposition, CUDA's range check of an
    # accumulating put (two .item() calls; the backward of x[mask] also expands the mask), the
    # range of histc's values read where its bounds are equal in float32, matrix_exp's norms
    a, _, mask = _data()
    rows, ones = torch.tensor([0, 2, 2]), torch.ones(3, 4, dtype=a.dtype)

    def deterministic_put():
        torch.use_deterministic_algorithms(True)
        try:
            a.clone()[rows] = ones
        finally:
            torch.use_deterministic_algorithms(False)

    def backward_of_mask():
        x = a.clone().requires_grad_()
        x[mask].sum().backward()  # the forward's mask and its backward's put: 2

    reads = {
        "cpu()": lambda: a.cpu(),
        "eig": lambda: torch.linalg.eig(a[:4]),
        "eigvals": lambda: torch.linalg.eigvals(a[:4]),
        "index_put_ accumulating": lambda: a.clone().index_put_((rows,), ones, accumulate=True),
        "index_put accumulating": lambda: a.index_put((rows,), ones, accumulate=True),
        "x[rows] = v deterministic": deterministic_put,
        "histc, bounds equal in float32": lambda: torch.histc(a.float(), bins=4, min=1.0, max=1.0 + 1e-9),
        "backward of x[mask]": backward_of_mask,
        "matrix_exp": lambda: torch.linalg.matrix_exp(a[:4] / 10),  # its norms and squarings read
    }
    counted = {name: count_ops(read).syncs for name, read in reads.items()}
    assert counted == {**dict.fromkeys(reads, 1), "backward of x[mask]": 2}


def test_their_twins_that_a_gpu_runs_without_reading_count_none():
    # autograd's backward of x[rows] puts with unsafe=True (no range check); an empty histc reads
    # no range; a put that does not accumulate scatters without reading; nonzero_static's size is
    # given (CUDA counts and pads on the device)
    a, _, mask = _data()
    rows = torch.tensor([0, 2, 2])

    def backward_of_rows():
        x = a.clone().requires_grad_()
        x[rows].sum().backward()

    quiet = {
        "backward of x[rows]": backward_of_rows,
        "unsafe put": lambda: torch.ops.aten._index_put_impl_(
            a.clone(), (rows,), torch.ones(3, 4, dtype=a.dtype), True, True),
        "x[rows] = 1": lambda: a.clone().__setitem__(rows, 1.0),
        "histc of nothing": lambda: torch.histc(torch.empty(0), bins=4),
        "histc, bounds apart in float64": lambda: torch.histc(a, bins=4, min=1.0, max=1.0 + 1e-9),
        "nonzero_static": lambda: torch.nonzero_static(mask, size=4),
        "matrix_exp of 1 x 1": lambda: torch.linalg.matrix_exp(a[:1, :1]),  # exp
    }
    counted = {name: count_ops(read).syncs for name, read in quiet.items()}
    assert counted == dict.fromkeys(quiet, 0)


def test_copies_between_the_host_and_a_device_count_as_syncs():
    # tensors that report a CUDA device without CUDA (FakeTensorMode): a blocking copy either
    # way ends in a stream synchronization (ATen's cuda/Copy.cu), so does a non-blocking one into
    # pageable host memory; .to(..., non_blocking=True) to the host allocates pinned memory
    with FakeTensorMode():
        x = torch.empty(6, 4, device="cuda")
        host = torch.ones(6, 4)
        copies = {
            "cpu()": lambda: x.cpu(),
            "to('cpu')": lambda: x.to("cpu"),
            "to('cpu', float64)": lambda: x.to("cpu", torch.float64),
            "host.copy_(x)": lambda: torch.empty(6, 4).copy_(x),
            "host.copy_(x, non_blocking)": lambda: torch.empty(6, 4).copy_(x, non_blocking=True),
            "host.to(x.device)": lambda: host.to(x.device),
            "tensor(list, device)": lambda: torch.tensor([1.0, 2.0], device="cuda"),
            "masked_fill(mask, device value)": lambda: x.masked_fill(x > 0, x.sum()),  # value.item()
        }
        twins = {
            "to('cpu', non_blocking)": lambda: x.to("cpu", non_blocking=True),
            "host.to(x.device, non_blocking)": lambda: host.to(x.device, non_blocking=True),
            "to(float64)": lambda: x.to(torch.float64),
            "x @ x.mT": lambda: x @ x.mT,
            "masked_fill(mask, host value)": lambda: x.masked_fill(x > 0, torch.tensor(1.0)),
            "where(mask, x, device value)": lambda: torch.where(x > 0, x, x.sum()),
        }
        counted = {name: count_ops(copy).syncs for name, copy in {**copies, **twins}.items()}
        ops = count_ops(lambda: x.to("cpu", non_blocking=True)).ops  # its device queries are no kernels
    assert counted == {**dict.fromkeys(copies, 1), **dict.fromkeys(twins, 0)}
    assert ops == 1


def test_lstsq_and_the_backward_of_masked_scatter_count_as_syncs_its_forward_none():
    """linalg.lstsq (its error check reads the LAPACK / cuSOLVER infos on the host, CUDA's gels too)
    and masked_scatter's backward (a masked_select) counted 0; the forward sums its mask on the
    device (aten/src/ATen/native/cuda/IndexKernel.cu) and stays 0."""
    a, _, mask = _data()
    source = torch.arange(24, dtype=a.dtype)

    def backward_of_masked_scatter():
        s = source.clone().requires_grad_()
        a.masked_scatter(mask, s).sum().backward()  # the forward's masked_scatter_ reads nothing: 1

    counted = {
        "lstsq": count_ops(lambda: torch.linalg.lstsq(a, a[:, :2])).syncs,
        "lstsq gels": count_ops(lambda: torch.linalg.lstsq(a, a[:, :2], driver="gels")).syncs,
        "masked_scatter_": count_ops(lambda: a.clone().masked_scatter_(mask, source)).syncs,
        "backward of masked_scatter": count_ops(backward_of_masked_scatter).syncs,
    }
    assert counted == {"lstsq": 1, "lstsq gels": 1, "masked_scatter_": 0, "backward of masked_scatter": 1}
