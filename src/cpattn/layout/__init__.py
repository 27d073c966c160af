"""Layouts: which rank holds which token (host-side plans and index maps)."""
