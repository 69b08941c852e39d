// Command conformance-registry serves the few images containerd's
// integration/client suite pulls, offline: an HTTP CONNECT proxy on
// 127.0.0.1 that refuses every host but the registries of those images,
// and terminates TLS for them with certificates of a private CA made at
// start, in front of a minimal read-only OCI distribution API. The suite
// runs unpatched against it with HTTPS_PROXY and SSL_CERT_FILE set.
//
//	conformance-registry serve --dir DIR   (writes DIR/ca.pem and DIR/proxy.url, serves until killed)
//	conformance-registry table --results FILE --logs DIR --md FILE --json FILE
//
// Standard library only, so that Debian's Go builds it with no module download.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: conformance-registry serve|table [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "table":
		err = table(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "conformance-registry:", err)
		os.Exit(1)
	}
}

// ca mints a server certificate for each host name it is asked for.
type ca struct {
	cert  *x509.Certificate
	key   *ecdsa.PrivateKey
	mu    sync.Mutex
	leafs map[string]*tls.Certificate
}

func newCA() (*ca, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "shadow conformance test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(48 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	return &ca{cert: cert, key: key, leafs: map[string]*tls.Certificate{}}, pemBytes, nil
}

func (c *ca) leaf(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
	host := hello.ServerName
	c.mu.Lock()
	defer c.mu.Unlock()
	if l, ok := c.leafs[host]; ok {
		return l, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(48 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		return nil, err
	}
	l := &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	c.leafs[host] = l
	return l, nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	dir := fs.String("dir", "", "where to write ca.pem and proxy.url")
	listen := fs.String("listen", "127.0.0.1:0", "the proxy's address")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" {
		return fmt.Errorf("serve: --dir is required")
	}
	images, err := buildImages()
	if err != nil {
		return err
	}
	hosts := map[string]bool{}
	for ref := range images.tags {
		hosts[strings.SplitN(ref, "/", 2)[0]] = true
	}
	authority, caPEM, err := newCA()
	if err != nil {
		return err
	}

	// The registry: TLS on a loopback port of its own; the proxy splices
	// each allowed CONNECT onto it.
	regLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	tlsLn := tls.NewListener(regLn, &tls.Config{GetCertificate: authority.leaf, MinVersion: tls.VersionTLS12})
	go func() {
		log.Fatal(http.Serve(tlsLn, &registry{images: images}))
	}()

	proxyLn, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(*dir, "ca.pem"), caPEM, 0o644); err != nil {
		return err
	}
	url := "http://" + proxyLn.Addr().String()
	// proxy.url last: its presence tells the caller everything is ready.
	tmp := filepath.Join(*dir, "proxy.url.tmp")
	if err := os.WriteFile(tmp, []byte(url+"\n"), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(*dir, "proxy.url")); err != nil {
		return err
	}
	log.Printf("proxy %s, registry for %d images on %v", url, len(images.tags), keys(hosts))
	return http.Serve(proxyLn, &proxy{hosts: hosts, registry: regLn.Addr().String()})
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// proxy accepts CONNECT to the hosts it has images for and refuses everything else.
type proxy struct {
	hosts    map[string]bool
	registry string
}

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	host, port, err := net.SplitHostPort(r.Host)
	if r.Method != http.MethodConnect || err != nil || port != "443" || !p.hosts[host] {
		log.Printf("refused %s %s", r.Method, r.Host)
		http.Error(w, "offline: this proxy serves only the conformance test images", http.StatusForbidden)
		return
	}
	upstream, err := net.Dial("tcp", p.registry)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		upstream.Close()
		http.Error(w, "no hijack", http.StatusInternalServerError)
		return
	}
	client, buf, err := hj.Hijack()
	if err != nil {
		upstream.Close()
		return
	}
	if _, err := client.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		client.Close()
		upstream.Close()
		return
	}
	// Bytes the client sent after the CONNECT line are already buffered.
	if n := buf.Reader.Buffered(); n > 0 {
		pending, _ := buf.Reader.Peek(n)
		if _, err := upstream.Write(pending); err != nil {
			client.Close()
			upstream.Close()
			return
		}
	}
	go func() {
		_, _ = io.Copy(upstream, client)
		upstream.Close()
	}()
	_, _ = io.Copy(client, upstream)
	client.Close()
}

// registry is the read-only part of the OCI distribution API the pulls use:
// /v2/, manifests by tag or digest, blobs by digest; GET and HEAD.
type registry struct {
	images *store
}

func (g *registry) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	log.Printf("%s %s%s", r.Method, host, r.URL.Path)
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		http.Error(w, "read-only registry", http.StatusMethodNotAllowed)
		return
	}
	path := r.URL.Path
	if path == "/v2/" || path == "/v2" {
		w.Header().Set("Docker-Distribution-API-Version", "registry/2.0")
		return
	}
	if !strings.HasPrefix(path, "/v2/") {
		notFound(w, "NAME_UNKNOWN")
		return
	}
	rest := strings.TrimPrefix(path, "/v2/")
	var repo, kind, ref string
	for _, k := range []string{"/manifests/", "/blobs/"} {
		if i := strings.LastIndex(rest, k); i > 0 {
			repo, kind, ref = rest[:i], strings.Trim(k, "/"), rest[i+len(k):]
			break
		}
	}
	if repo == "" {
		notFound(w, "NAME_UNKNOWN")
		return
	}
	var digest, mediaType string
	switch kind {
	case "manifests":
		if strings.HasPrefix(ref, "sha256:") {
			digest = ref
		} else if d, ok := g.images.tags[host+"/"+repo+":"+ref]; ok {
			digest = d
		}
		mediaType = g.images.types[digest]
		if mediaType == "" {
			notFound(w, "MANIFEST_UNKNOWN")
			return
		}
	case "blobs":
		digest, mediaType = ref, "application/octet-stream"
	}
	data, ok := g.images.blobs[digest]
	if !ok {
		notFound(w, "BLOB_UNKNOWN")
		return
	}
	w.Header().Set("Content-Type", mediaType)
	w.Header().Set("Docker-Content-Digest", digest)
	w.Header().Set("Content-Length", fmt.Sprint(len(data)))
	if r.Method == http.MethodGet {
		_, _ = w.Write(data)
	}
}

func notFound(w http.ResponseWriter, code string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	fmt.Fprintf(w, `{"errors":[{"code":%q,"message":"not served by the offline conformance registry"}]}`, code)
}
