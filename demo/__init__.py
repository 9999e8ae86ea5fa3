"""``make demo``: a GPT-style byte-level language model trained in every half format, with and
without loss scaling, against float32, through both front doors (see :mod:`demo.cli`)."""
