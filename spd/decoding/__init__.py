"""Decoding on the staged target: exact AR, the pipelined chain and tree engines, serial drafting (sd),
token trees and their verification, sampling, and the statistics every decoder returns."""
