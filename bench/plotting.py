"""The benches' one way to get matplotlib: headless, and optional (a bench without it
still writes its JSON and Markdown)."""


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path, dpi: int = 110) -> None:
    """Write ``fig`` to ``path`` laid out tight, and release it (pyplot keeps every figure
    alive until it is closed)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
