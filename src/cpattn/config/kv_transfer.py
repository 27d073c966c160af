"""``KVTransferConfig``: KV moving between engines (vLLM's ``KVTransferConfig``).

``kv_transfer``: None, "pd" (prefill/decode disaggregation) or "pool"
(KV-cache pooling). With "pd" each engine has a ``kv_role``:
"kv_producer" (prefill), "kv_consumer" (decode) or "kv_both".
``use_layerwise``: the pooling store connector moves KV layer by layer
(the guide: not with PCP).

Example
-------
>>> KVTransferConfig(kv_transfer="PD", kv_role="KV_Consumer").kv_role
'kv_consumer'
"""

from __future__ import annotations

from dataclasses import dataclass

from cpattn.config.problems import Checked, normalize, one_of, problem

KV_TRANSFERS = (None, "pd", "pool")
KV_ROLES = (None, "kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig(Checked):
    """kv_transfer, kv_role, use_layerwise (see module doc)."""

    kv_transfer: str | None = None
    kv_role: str | None = None
    use_layerwise: bool = False

    def _normalize(self) -> None:
        normalize(self, {"kv_transfer": str.lower, "kv_role": str.lower})

    def field_problems(self) -> list[str]:
        return one_of(self, {"kv_transfer": KV_TRANSFERS, "kv_role": KV_ROLES})

    def rule_problems(self) -> list[str]:
        out = []
        if self.kv_role is not None and self.kv_transfer != "pd":
            out.append(problem("kv_role", f"{self.kv_role!r} with kv_transfer={self.kv_transfer!r}",
                               'kv_role describes an engine of a P/D pair (kv_transfer="pd")',
                               'set kv_transfer="pd" or kv_role=None'))
        if self.kv_transfer == "pd" and self.kv_role is None:
            out.append(problem("kv_role", 'None with kv_transfer="pd"', "each engine of a P/D pair has a role",
                               'pass kv_role="kv_producer" (prefill engine) or "kv_consumer" (decode engine)'))
        return out
