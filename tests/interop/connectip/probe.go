package main

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// probe sends what a standard client never would, to see the server refuse it: an Extended
// CONNECT with another :protocol or path, or with extra fields (-header), prints "STATUS n"; then, once answered 2xx, a raw
// capsule (-capsule HEX: prints "STREAM_CLOSED" when the server aborts the stream) or IPv4 echo
// requests from a source address that is not the session's (-spoof SRC -to DST).
func probe(args []string) {
	fs := flag.NewFlagSet("probe", flag.ExitOnError)
	url := fs.String("url", "", "request URL")
	ca := fs.String("ca", "", "CA file")
	sni := fs.String("sni", "", "server name")
	token := fs.String("token", "", "bearer token")
	protocol := fs.String("protocol", "connect-ip", ":protocol")
	capsule := fs.String("capsule", "", "raw capsule bytes to send after the answer, hex")
	spoof := fs.String("spoof", "", "send IPv4 echo requests from this source address")
	to := fs.String("to", "", "their destination")
	var headers routes
	fs.Var(&headers, "header", "NAME:VALUE, a field of the request (repeatable)")
	fs.Parse(args)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodConnect, *url, nil)
	if err != nil {
		log.Fatal(err)
	}
	req.Proto = *protocol
	req.Host = req.URL.Host
	req.Header.Set(http3.CapsuleProtocolHeader, "?1")
	if *token != "" {
		req.Header.Set("Authorization", "Bearer "+*token)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ":")
		req.Header.Set(name, value)
	}
	tlsConf := &tls.Config{RootCAs: caPool(*ca), ServerName: *sni, NextProtos: []string{http3.NextProtoH3}}
	qconn, err := quic.DialAddr(ctx, req.URL.Host, tlsConf, &quic.Config{EnableDatagrams: true})
	if err != nil {
		log.Fatalf("dial: %v", err)
	}
	cc := (&http3.Transport{EnableDatagrams: true}).NewClientConn(qconn)
	select {
	case <-cc.ReceivedSettings():
	case <-ctx.Done():
		log.Fatal("no SETTINGS from the server")
	}
	str, err := cc.OpenRequestStream(ctx)
	if err != nil {
		log.Fatal(err)
	}
	if err := str.SendRequestHeader(req); err != nil {
		log.Fatal(err)
	}
	rsp, err := str.ReadResponse()
	if err != nil {
		log.Fatalf("response: %v", err)
	}
	fmt.Printf("STATUS %d\n", rsp.StatusCode)
	os.Stdout.Sync()
	if rsp.StatusCode < 200 || rsp.StatusCode > 299 {
		return
	}
	if *capsule != "" {
		raw, err := hex.DecodeString(*capsule)
		if err != nil {
			log.Fatal(err)
		}
		if _, err := str.Write(raw); err != nil {
			log.Fatal(err)
		}
		_, err = io.Copy(io.Discard, str)
		fmt.Printf("STREAM_CLOSED %v\n", err)
		return
	}
	if *spoof != "" {
		for i := 0; i < 5; i++ {
			pkt := echo(netip.MustParseAddr(*spoof), netip.MustParseAddr(*to), uint16(i))
			if err := str.SendDatagram(append([]byte{0}, pkt...)); err != nil {
				log.Fatal(err)
			}
		}
		time.Sleep(500 * time.Millisecond)
		fmt.Println("SENT 5")
	}
}

// echo is an IPv4 ICMP echo request from src to dst.
func echo(src, dst netip.Addr, seq uint16) []byte {
	p := make([]byte, 28)
	p[0], p[8], p[9] = 0x45, 64, 1
	binary.BigEndian.PutUint16(p[2:], uint16(len(p)))
	s, d := src.As4(), dst.As4()
	copy(p[12:], s[:])
	copy(p[16:], d[:])
	binary.BigEndian.PutUint16(p[10:], checksum(p[:20]))
	p[20] = 8
	binary.BigEndian.PutUint16(p[26:], seq)
	binary.BigEndian.PutUint16(p[22:], checksum(p[20:]))
	return p
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
