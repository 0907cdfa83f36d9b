"""The streaming datasets: ``AsyncStreamingDataset`` (``_async``) and its prefetcher
(``_prefetch``), the PyTorch adapter (``_torch``), DataLoader hand-offs (``_handoff``)."""
