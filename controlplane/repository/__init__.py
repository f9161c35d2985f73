"""The control plane's model repository: TUF metadata and keys (:mod:`.tuf_repo`)."""
