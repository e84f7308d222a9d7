package redistest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// tlsFiles are a throwaway CA, a server certificate it signed for 127.0.0.1
// and localhost, and a client certificate it signed, written as PEM files
// into a server's directory.
type tlsFiles struct {
	ca, cert, key         string
	clientCert, clientKey string
	roots                 *x509.CertPool
	client                tls.Certificate
}

func writeTLSFiles(dir string) (*tlsFiles, error) {
	ca, err := NewCA("redistest CA")
	if err != nil {
		return nil, err
	}
	f := &tlsFiles{
		ca:         filepath.Join(dir, "ca.pem"),
		cert:       filepath.Join(dir, "server.pem"),
		key:        filepath.Join(dir, "server.key"),
		clientCert: filepath.Join(dir, "client.pem"),
		clientKey:  filepath.Join(dir, "client.key"),
		roots:      x509.NewCertPool(),
	}
	f.roots.AddCert(ca.cert)
	if err := os.WriteFile(f.ca, ca.PEM(), 0o600); err != nil {
		return nil, err
	}
	server := &x509.Certificate{
		Subject:     pkix.Name{CommonName: "redistest server"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:    []string{"localhost"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	if _, err := ca.issue(server, f.cert, f.key); err != nil {
		return nil, err
	}
	if f.client, err = ca.IssueClient("redistest client", f.clientCert, f.clientKey); err != nil {
		return nil, err
	}
	return f, nil
}

// clientTLS is the client side of a TLS server: its CA is the only root,
// and it presents the client certificate when the server asks for one.
func (f *tlsFiles) clientTLS() *tls.Config {
	return &tls.Config{RootCAs: f.roots, MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{f.client}}
}

// CA is a throwaway certificate authority for tests: Server uses one per
// TLS server, and a test makes its own to issue certificates a server does
// not trust.
type CA struct {
	cert   *x509.Certificate
	key    *ecdsa.PrivateKey
	serial int64
}

// NewCA makes a CA valid from an hour ago for a day.
func NewCA(name string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, serial: 1}, nil
}

// PEM is the CA's certificate in PEM.
func (ca *CA) PEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
}

// IssueClient signs a client certificate (TLS client auth) named name and
// writes it and its key as PEM files to certFile and keyFile.
func (ca *CA) IssueClient(name, certFile, keyFile string) (tls.Certificate, error) {
	return ca.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: name},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, certFile, keyFile)
}

// issue fills tmpl's serial, validity and key usage, signs it and writes
// the certificate and its key to certFile and keyFile.
func (ca *CA) issue(tmpl *x509.Certificate, certFile, keyFile string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	ca.serial++
	now := time.Now()
	tmpl.SerialNumber = big.NewInt(ca.serial)
	tmpl.NotBefore, tmpl.NotAfter = now.Add(-time.Hour), now.Add(24*time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return tls.Certificate{}, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return tls.Certificate{}, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		return tls.Certificate{}, err
	}
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		return tls.Certificate{}, err
	}
	return tls.X509KeyPair(certPEM, keyPEM)
}
