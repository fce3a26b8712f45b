"""count_ops: which calls count as host synchronizations (what a GPU would wait for)."""

from __future__ import annotations

import torch

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
