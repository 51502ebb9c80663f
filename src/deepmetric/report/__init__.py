"""deepmetric.report"""
