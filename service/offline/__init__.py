"""Offline jobs on a Ray cluster: a Ray Data processor whose engine actors answer a dataset's rows (`processor`)."""
