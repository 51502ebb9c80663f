"""deepmetric.evaluate"""
