"""Sizes as people read them, for the command line and the logs."""


def size_text(n: float) -> str:
    """Bytes in binary units: "1.50 GiB", "512 B"."""
    units, k = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while n >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} B" if k == 0 else f"{n:.2f} {units[k]}"
