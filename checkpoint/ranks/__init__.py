"""Where ranks talk (``dist``: every collective of a save / load) and how tests, examples and the demo
spawn them (``launch``)."""
