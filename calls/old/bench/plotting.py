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
