"""The shared snapshot format: segment layout, manifest, chunk hashes (verify), the DCP layout on disk."""
