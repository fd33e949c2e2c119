"""Reference log-probs scored once, before DPO trains (``DPOModule(precompute_ref_logprobs=True)``).

The reference policy scores every pair of the data module's splits when fitting starts; the table of
(chosen, rejected) log-probs per row is looked up by ``row_index`` during training and the reference is freed.
A table is keyed by its data set's fingerprint, so another data set under a split's name is scored anew (or
refused once the reference is gone).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lit_rlhf.guards import NonFiniteError

__all__ = ["PrecomputedReference"]


class PrecomputedReference:
    """The precomputed reference tables of :class:`~lit_rlhf.modules.DPOModule`, a mixin of its Lightning
    module: it needs ``hparams.precompute_ref_logprobs``, ``reference``, ``model`` and
    ``_score_reference(batch, layout)`` / ``_pair_layout(model, batch)`` of the module."""

    def _init_reference_tables(self) -> None:
        # split -> (rows, 2) float32 reference log-probs (chosen, rejected) summed over the response
        self.ref_logps: dict[str, torch.Tensor] = {}
        self._ref_sources: dict[str, tuple[int, str]] = {}  # split -> (rows, fingerprint) of the scored data
        self._reference_released = False

    def _lookup(self, batch: dict[str, torch.Tensor], split: str) -> torch.Tensor:
        if "row_index" not in batch:
            raise KeyError(
                "DPOModule(precompute_ref_logprobs=True): batches need a `row_index` (B,) column, as "
                "PreferenceDataModule's collator gives"
            )
        if split not in self.ref_logps:
            raise RuntimeError(f"DPOModule: no precomputed reference log-probs for the {split} split")
        table = self.ref_logps[split]  # (rows, 2)
        pairs = table[batch["row_index"].to(table.device)]  # (B, 2)
        return torch.cat([pairs[:, 0], pairs[:, 1]])  # (2B,) chosen rows first

    def _precompute(self, splits: tuple[str, ...]) -> None:
        """Score every pair of the data module's ``splits`` with the reference, keyed by row."""
        datamodule = self.trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "collator"):
            raise ValueError(
                "DPOModule(precompute_ref_logprobs=True) reads the whole data set from a data module with "
                "`train_dataset`, `val_dataset` and `collator` (PreferenceDataModule); pass one to the Trainer"
            )
        for split in splits:
            dataset = getattr(datamodule, f"{split}_dataset", None)
            if dataset is None:
                continue
            # the tables are looked up by row: another data set under the split's name is scored anew
            source = (len(dataset), str(getattr(dataset, "_fingerprint", id(dataset))))
            if self._ref_sources.get(split) == source:
                continue
            if self._reference_released:
                raise RuntimeError(
                    f"DPOModule(precompute_ref_logprobs=True): the {split} split is not one scored when the fit"
                    f" started, and the reference was freed after precomputing; build a new module (or give the"
                    f" data module this {split} split before fit)"
                )
            with self.trainer.precision_plugin.forward_context():  # as the policy's forwards (bf16-mixed)
                self.ref_logps[split] = self._score_dataset(
                    dataset, datamodule.collator, datamodule.hparams.batch_size, split
                )
            self._ref_sources[split] = source

    @torch.no_grad()
    def _score_dataset(self, dataset: Dataset, collator: Any, batch_size: int, split: str = "train") -> torch.Tensor:
        """(rows, 2) reference log-probs of (chosen, rejected); each rank scores a share, then all-gather.

        The unshuffled ``DistributedSampler`` pads every rank to the same number of rows, so all ranks
        run the same forwards (FSDP needs every rank in every forward). Rows that no batch covered and
        non-finite log-probs (a reference with NaN/inf weights) are refused with different messages.
        """
        world, rank = self.trainer.world_size, self.global_rank
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        indices, logps = [], []
        for batch in DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collator):
            batch = self.transfer_batch_to_device(batch, self.device, 0)
            indices.append(batch["row_index"])  # (B,)
            model = self.reference if self.reference is not None else self.model
            layout = self._pair_layout(model, batch)
            logps.append(torch.stack(self._score_reference(batch, layout).chunk(2), dim=1))  # (B, 2)
        indices, logps = torch.cat(indices), torch.cat(logps)  # (n,), (n, 2)
        if world > 1:
            indices, logps = self.all_gather(indices).flatten(), self.all_gather(logps).reshape(-1, 2)
        table = torch.zeros((len(dataset), 2), device=self.device)
        covered = torch.zeros(len(dataset), dtype=torch.bool, device=self.device)
        table[indices], covered[indices] = logps, True
        if not covered.all():
            missing = (~covered).nonzero().flatten().tolist()
            raise RuntimeError(
                f"DPOModule: {len(missing)} rows of the {split} split got no reference log-probs (rows"
                f" {missing[:8]}{' ...' if len(missing) > 8 else ''}; row_index out of order?)"
            )
        bad = (~torch.isfinite(table)).any(dim=1)  # (rows,)
        if bad.any():
            rows = bad.nonzero().flatten().tolist()
            raise NonFiniteError(
                f"DPOModule(precompute_ref_logprobs=True): the reference model ({self._reference_name()}) gave"
                f" non-finite (NaN/inf) log-probs for {len(rows)} of {len(table)} pairs of the {split} split"
                f" (row_index {rows[:8]}{' ...' if len(rows) > 8 else ''}); are its weights finite?"
            )
        return table

    def _reference_name(self) -> str:
        """The reference as the user gave it: its spec's path/config, or the initial policy."""
        spec = self.hparams.get("reference")
        if spec is None:
            spec, which = self.hparams.get("model"), "the initial policy"
        else:
            which = "reference"
        spec = spec if isinstance(spec, dict) else getattr(spec, "__dict__", {})
        where = spec.get("name_or_path") or ("inline config" if spec.get("config") else None)
        return f"{which}, {where}" if where else which

    def _precompute_for_fit(self) -> None:
        """Score train, val (and test, where the data module holds one) and free the reference."""
        datamodule = self.trainer.datamodule
        held_out = getattr(datamodule, "held_out", None)
        if held_out is not None and held_out("test") is not None:
            datamodule.setup("test")  # scored now too: fit() then test() on this module needs no reference
        self._precompute(("train", "val", "test"))
        # the reference leaves memory (a LoRA policy's adapters simply stay enabled)
        self.reference, self._reference_released = None, self.reference is not None
