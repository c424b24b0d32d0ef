"""``dreamstep caption``: captions for a folder of pictures. :mod:`.targets` decides what is captioned and where
captions go, :mod:`.models` loads and runs the captioners, :mod:`.run` is the command's loop, :mod:`.tiny`
writes tiny random captioners for offline tests."""
