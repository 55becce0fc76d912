"""The chaos schedule: the whole three-region deployment under load while a seeded schedule of faults runs."""
