"""Process-level plumbing: the launcher's environment (``env``), the process group and
its named collectives (``group``, ``collectives``), and self-launch (``launch``)."""
