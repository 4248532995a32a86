"""The test kit in parts; ``tests.netkit`` gathers them under one name."""
