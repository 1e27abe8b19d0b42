// A standard CONNECT-IP (RFC 9484) client and server built on quic-go's connect-ip-go, an
// implementation independent of mpquic's: the interop tests (tests/e2e/test_masque.py) run
// them against mpquic's server and client. Each moves IP packets between a TUN device and one
// CONNECT-IP session (the server: the newest, which replaces the one before).
//
//	connectip client -url https://HOST:PORT/PATH -ca ca.crt [-sni NAME] [-token T] [-ask CIDR] [-tun NAME] [-route CIDR]...
//	connectip probe -url URL -ca ca.crt [-protocol P] [-capsule HEX | -spoof SRC -to DST]
//	connectip server -listen ADDR:PORT -cert srv.crt -key srv.key -path /PATH -assign CIDR[,CIDR6] [-tun NAME]
//
// The client prints "ASSIGNED <prefix>" for each address it is given and "ROUTE <start>-<end>"
// for each advertised range, then "READY"; a refused request exits 3 with "REFUSED <status>".
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"log"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"time"

	connectip "github.com/quic-go/connect-ip-go"
	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
	"github.com/songgao/water"
	"github.com/vishvananda/netlink"
	"github.com/yosida95/uritemplate/v3"
)

type routes []string

func (r *routes) String() string     { return strings.Join(*r, ",") }
func (r *routes) Set(s string) error { *r = append(*r, s); return nil }

func main() {
	log.SetFlags(log.Lmicroseconds)
	if len(os.Args) < 2 {
		log.Fatal("usage: connectip client|server ...")
	}
	switch os.Args[1] {
	case "client":
		client(os.Args[2:])
	case "server":
		server(os.Args[2:])
	case "probe":
		probe(os.Args[2:])
	default:
		log.Fatalf("unknown mode %q", os.Args[1])
	}
}

// tunDevice makes a TUN device with the given addresses (and routes), up, MTU 1280.
func tunDevice(name string, addrs []netip.Prefix, rts []string) *water.Interface {
	dev, err := water.New(water.Config{DeviceType: water.TUN, PlatformSpecificParams: water.PlatformSpecificParams{Name: name}})
	if err != nil {
		log.Fatalf("tun: %v", err)
	}
	link, err := netlink.LinkByName(dev.Name())
	if err != nil {
		log.Fatalf("tun link: %v", err)
	}
	if err := netlink.LinkSetMTU(link, 1280); err != nil {
		log.Fatalf("tun mtu: %v", err)
	}
	for _, p := range addrs {
		a, _ := netlink.ParseAddr(p.String())
		if err := netlink.AddrAdd(link, a); err != nil {
			log.Fatalf("tun addr %s: %v", p, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		log.Fatalf("tun up: %v", err)
	}
	for _, r := range rts {
		_, dst, err := netParse(r)
		if err != nil {
			log.Fatalf("route %s: %v", r, err)
		}
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: dst}); err != nil {
			log.Fatalf("route %s: %v", r, err)
		}
	}
	return dev
}

// fromTun sends the TUN's packets into the session `to` names at the time (none: dropped),
// until the device fails.
func fromTun(dev *water.Interface, to func() *connectip.Conn) error {
	b := make([]byte, 2000)
	for {
		n, err := dev.Read(b)
		if err != nil {
			return fmt.Errorf("tun read: %w", err)
		}
		conn := to()
		if conn == nil {
			continue
		}
		icmp, err := conn.WritePacket(b[:n])
		if err != nil {
			log.Printf("write packet: %v", err)
		}
		if len(icmp) > 0 {
			dev.Write(icmp)
		}
	}
}

// pump moves packets both ways until one side fails.
func pump(dev *water.Interface, conn *connectip.Conn) {
	errs := make(chan error, 2)
	go func() { errs <- fromTun(dev, func() *connectip.Conn { return conn }) }()
	go func() {
		b := make([]byte, 2000)
		for {
			n, err := conn.ReadPacket(b)
			if err != nil {
				errs <- fmt.Errorf("read packet: %w", err)
				return
			}
			if _, err := dev.Write(b[:n]); err != nil {
				log.Printf("tun write: %v", err)
			}
		}
	}()
	log.Fatal(<-errs)
}

func caPool(file string) *x509.CertPool {
	pem, err := os.ReadFile(file)
	if err != nil {
		log.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		log.Fatalf("no certificate in %s", file)
	}
	return pool
}

func client(args []string) {
	fs := flag.NewFlagSet("client", flag.ExitOnError)
	url := fs.String("url", "", "the proxy's URI template (no variables)")
	ca := fs.String("ca", "", "CA file that signed the server's certificate")
	token := fs.String("token", "", "bearer token")
	tunName := fs.String("tun", "cip0", "TUN device")
	ask := fs.String("ask", "", "an address to ask for (ADDRESS_REQUEST), e.g. 10.9.0.7/32")
	sni := fs.String("sni", "", "the server's name in its certificate (default: the URL's host)")
	var rts routes
	fs.Var(&rts, "route", "a prefix to route into the tunnel (repeatable)")
	fs.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := connectip.NewRequest(ctx, uritemplate.MustNew(*url))
	if err != nil {
		log.Fatal(err)
	}
	if *token != "" {
		req.Header().Set("Authorization", "Bearer "+*token)
	}
	tr := &connectip.Transport{
		TLSClientConfig: &tls.Config{RootCAs: caPool(*ca), ServerName: *sni, NextProtos: []string{http3.NextProtoH3}},
		QUICConfig:      &quic.Config{EnableDatagrams: true, InitialPacketSize: 1350, KeepAlivePeriod: 5 * time.Second, MaxIdleTimeout: 30 * time.Second},
	}
	conn, rsp, err := tr.Dial(req)
	if err != nil {
		if rsp != nil {
			fmt.Printf("REFUSED %d\n", rsp.StatusCode)
			os.Exit(3)
		}
		log.Fatalf("dial: %v", err)
	}
	if *ask != "" {
		if _, err := conn.RequestAddresses([]netip.Prefix{netip.MustParsePrefix(*ask)}); err != nil {
			log.Fatalf("request addresses: %v", err)
		}
	}
	// Each assignment replaces the one before; with -ask, until the one that answers it.
	var addrs []netip.Prefix
	for answered := *ask == ""; len(addrs) == 0 || !answered; {
		assigned, err := conn.ReceiveAddressAssignment(ctx)
		if err != nil {
			log.Fatalf("no address assigned: %v", err)
		}
		addrs = addrs[:0]
		for _, a := range assigned {
			if a.RequestID != 0 {
				answered = true
			}
			if a.Rejected() {
				fmt.Printf("REJECTED %d\n", a.RequestID)
				continue
			}
			fmt.Printf("ASSIGNED %s\n", a.IPPrefix)
			addrs = append(addrs, a.IPPrefix)
		}
	}
	advertised, err := conn.Routes(ctx)
	if err != nil {
		log.Fatalf("no routes: %v", err)
	}
	for _, r := range advertised {
		fmt.Printf("ROUTE %s-%s\n", r.StartIP, r.EndIP)
	}
	dev := tunDevice(*tunName, addrs, rts)
	fmt.Println("READY")
	os.Stdout.Sync()
	pump(dev, conn)
}

func server(args []string) {
	fs := flag.NewFlagSet("server", flag.ExitOnError)
	listen := fs.String("listen", "", "UDP address")
	cert := fs.String("cert", "", "certificate")
	key := fs.String("key", "", "key")
	path := fs.String("path", "/vpn", "the request path served")
	assign := fs.String("assign", "", "the client's address(es), comma-separated prefixes")
	tunName := fs.String("tun", "cips0", "TUN device")
	local := fs.String("local", "", "the server's own tunnel address(es) on its TUN device, comma-separated prefixes")
	fs.Parse(args)
	pair, err := tls.LoadX509KeyPair(*cert, *key)
	if err != nil {
		log.Fatal(err)
	}
	var given []netip.Prefix
	for _, s := range strings.Split(*assign, ",") {
		given = append(given, netip.MustParsePrefix(s))
	}
	var own []netip.Prefix
	for _, s := range strings.Split(*local, ",") {
		if s != "" {
			own = append(own, netip.MustParsePrefix(s))
		}
	}
	var rts []string
	for _, p := range given {
		rts = append(rts, p.String())
	}
	dev := tunDevice(*tunName, own, rts)
	// One session at a time has the address it assigns (the same to every client): the TUN's
	// packets go to the newest, and a new session closes the one before (a client that moved
	// to another path; its old connection may be black-holed and never say goodbye).
	var current atomic.Pointer[connectip.Conn]
	go func() { log.Fatal(fromTun(dev, current.Load)) }()
	proxy := connectip.Proxy{}
	mux := http.NewServeMux()
	mux.HandleFunc(*path, func(w http.ResponseWriter, r *http.Request) {
		// Served under whatever name the client reached it by.
		template := uritemplate.MustNew("https://" + r.Host + *path)
		req, err := connectip.ParseProxyRequest(r, template)
		if err != nil {
			log.Printf("request refused: %v", err)
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		conn, err := proxy.Proxy(w, req)
		if err != nil {
			log.Printf("proxy: %v", err)
			return
		}
		if err := conn.AssignAddresses(given); err != nil {
			log.Printf("assign: %v", err)
			return
		}
		var ranges []connectip.IPRoute
		ranges = append(ranges, connectip.IPRoute{StartIP: netip.MustParseAddr("0.0.0.0"), EndIP: netip.MustParseAddr("255.255.255.255")})
		if len(given) > 1 {
			ranges = append(ranges, connectip.IPRoute{StartIP: netip.IPv6Unspecified(), EndIP: netip.MustParseAddr("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")})
		}
		if err := conn.AdvertiseRoute(ranges); err != nil {
			log.Printf("routes: %v", err)
			return
		}
		log.Printf("session open for %s", r.RemoteAddr)
		if old := current.Swap(conn); old != nil {
			log.Printf("the session before is replaced")
			old.Close()
		}
		b := make([]byte, 2000)
		for {
			n, err := conn.ReadPacket(b)
			if err != nil {
				log.Printf("session for %s ended: %v", r.RemoteAddr, err)
				current.CompareAndSwap(conn, nil)
				return
			}
			if _, err := dev.Write(b[:n]); err != nil {
				log.Printf("tun write: %v", err)
			}
		}
	})
	srv := http3.Server{
		Addr:            *listen,
		Handler:         mux,
		EnableDatagrams: true,
		TLSConfig:       http3.ConfigureTLSConfig(&tls.Config{Certificates: []tls.Certificate{pair}}),
		QUICConfig:      &quic.Config{EnableDatagrams: true, MaxIdleTimeout: 30 * time.Second},
	}
	log.Printf("listening on %s", *listen)
	log.Fatal(srv.ListenAndServe())
}
