"""deepmetric.train"""
