package main

import "net"

func netParse(s string) (net.IP, *net.IPNet, error) { return net.ParseCIDR(s) }
