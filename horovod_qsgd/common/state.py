"""What a compressor's ``state_dict()`` is checked against before it is loaded (both adapters)."""

STATE_FORMAT = 1
# Settings added after format 1 was first written; a state saved without them loads (their meaning did
# not change what the saved residuals and counters are).
LATER_SETTINGS = ("exchange", "second_stage_bits")
# Settings that change how payloads are packed into collectives, not what the saved state means.
PACKING_SETTINGS = ("fusion_threshold",)


def state_header(compressor, settings):
    """The part of a state dict that says what wrote it."""
    return {"format": STATE_FORMAT, "compressor": compressor, "settings": settings}


def check_loadable(state, compressor, settings):
    """Raises ValueError, naming the difference and the fix, unless ``state`` was written by such a compressor."""
    if state.get("format") != STATE_FORMAT or state.get("compressor") != compressor:
        raise ValueError(f"horovod_qsgd: cannot load a {state.get('compressor')!r} state (format "
                         f"{state.get('format')}) into {compressor} (format {STATE_FORMAT}).")
    saved = dict({k: v for k, v in settings.items() if k in LATER_SETTINGS}, **state["settings"])
    saved, settings = ({k: v for k, v in s.items() if k not in PACKING_SETTINGS} for s in (saved, settings))
    if saved != settings:
        differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise ValueError(f"horovod_qsgd: the state was written with settings {state['settings']}, this "
                         f"compressor has {settings} (they differ in {', '.join(differ)}); build it with the "
                         "same arguments.")
