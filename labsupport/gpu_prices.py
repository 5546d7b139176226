"""What a GPU-hour costs to rent: dated ranges with their sources (chapter 14).

Prices move month to month and differ several times over between providers for the same card, so the
course never plans with one "price": chapter 14's worked example takes an assumed price, and this
table says where real quotes stood, when, and according to whom. Each range is on-demand (no
commitment), per GPU per hour, in US dollars, as the source published it; reservations and spot
capacity are cheaper, and a bill adds storage, network and egress on top.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRICE_RANGES", "PriceRange", "price_ranges"]


@dataclass(frozen=True)
class PriceRange:
    gpu: str  # a labsupport.hardware name
    low: float  # US dollars per GPU-hour
    high: float
    tier: str  # which providers or which statistic
    as_of: str  # the month the source dates its figures
    source: str


_MERCATUS = "Mercatus AI, 'Cloud GPU Pricing' (blog, figures dated May 2026), on-demand tables by provider tier"
_AIMULTIPLE = "AIMultiple, 'Cloud GPU Rental Price Index' (updated 20 May 2026), median over listing providers"

PRICE_RANGES = (
    PriceRange("A100 80GB", 0.80, 3.00, "on-demand, long-tail providers to hyperscalers", "2026-05", _MERCATUS),
    PriceRange("H100 SXM", 1.99, 5.00, "on-demand, long-tail providers to hyperscalers", "2026-05", _MERCATUS),
    PriceRange("H200", 2.50, 7.00, "on-demand, long-tail providers to hyperscalers", "2026-05", _MERCATUS),
    PriceRange("H100 SXM", 2.95, 2.95, "on-demand median over 37 providers (above 7 in early 2024)", "2026-05",
               _AIMULTIPLE),
)


def price_ranges(gpu: str) -> list[PriceRange]:
    """Every range the table holds for ``gpu`` (its labsupport.hardware name)."""
    return [p for p in PRICE_RANGES if p.gpu == gpu]
