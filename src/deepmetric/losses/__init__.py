"""deepmetric.losses"""
