"""deepmetric.data"""
