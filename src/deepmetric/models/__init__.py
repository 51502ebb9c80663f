"""deepmetric.models"""
