"""Data formats and curation: the canonical conversation schema, source readers, adapters."""
