"""The streaming datasets: ``AsyncStreamingDataset`` (``_async``), the PyTorch adapter
(``_torch``), DataLoader hand-offs (``_handoff``)."""
