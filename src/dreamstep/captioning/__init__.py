"""``dreamstep caption``: captions for a folder of pictures. :mod:`.targets` decides what is captioned and where
captions go; :mod:`.captioner` loads a captioner (:mod:`.models`: the transformers ones, :mod:`.tagger`: WD14);
:mod:`.run` is the command's loop; :mod:`.tiny` writes tiny random captioners for offline tests."""
