package clustertls

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"strings"
	"time"
)

// clockSkew back-dates NotBefore so a freshly issued certificate is accepted
// by a peer whose clock is slightly behind the issuer's.
const clockSkew = 5 * time.Minute

// maxMemberName is the X.509 upper bound for a common name (RFC 5280 ub-common-name).
const maxMemberName = 64

// CA is a cluster certificate authority: it signs one certificate per member.
type CA struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte
	keyPEM  []byte
}

// ValidateMemberName checks that name can serve as a member identity: it is
// both the certificate CN and a DNS SAN, so it must be a lower-case DNS name
// of at most 64 bytes that is not an IP address (identity must not look like
// an address, since addresses move between hosts on fail-over).
func ValidateMemberName(name string) error {
	if name == "" {
		return errors.New("member name is empty")
	}
	if len(name) > maxMemberName {
		return fmt.Errorf("member name %q is longer than %d bytes", name, maxMemberName)
	}
	if _, err := netip.ParseAddr(name); err == nil {
		return fmt.Errorf("member name %q is an IP address; use a host-independent name such as node1", name)
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || len(label) > 63 {
			return fmt.Errorf("member name %q has an empty or over-long DNS label", name)
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("member name %q has a label starting or ending with '-'", name)
		}
		for _, c := range label {
			if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
				return fmt.Errorf("member name %q may only contain a-z, 0-9, '-' and '.'", name)
			}
		}
	}
	return nil
}

func randomSerial() (*big.Int, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generate serial number: %w", err)
	}
	return serial.Add(serial, big.NewInt(1)), nil // serials must be positive
}

// NewCA creates a self-signed ECDSA P-256 CA named name, valid for validity.
// It may sign member certificates only (path length 0).
func NewCA(name string, validity time.Duration) (*CA, error) {
	if strings.TrimSpace(name) == "" {
		return nil, errors.New("new CA: name is empty")
	}
	if validity <= 0 {
		return nil, fmt.Errorf("new CA %q: validity %v must be positive", name, validity)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("new CA %q: generate key: %w", name, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, fmt.Errorf("new CA %q: %w", name, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA %q: sign certificate: %w", name, err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("new CA %q: parse own certificate: %w", name, err)
	}
	keyPEM, err := encodeKeyPEM(key)
	if err != nil {
		return nil, fmt.Errorf("new CA %q: %w", name, err)
	}
	return &CA{cert: cert, key: key, certPEM: encodeCertPEM(der), keyPEM: keyPEM}, nil
}

// LoadCA rebuilds a CA from the PEM produced by CertPEM and KeyPEM. It checks
// that the certificate is a CA allowed to sign certificates and that the key
// belongs to it.
func LoadCA(certPEM, keyPEM []byte) (*CA, error) {
	certs, err := parseCertsPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA certificate: %w", err)
	}
	if len(certs) != 1 {
		return nil, fmt.Errorf("load CA certificate: found %d certificates, expected exactly 1", len(certs))
	}
	cert := certs[0]
	if !cert.BasicConstraintsValid || !cert.IsCA || cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, fmt.Errorf("load CA certificate: %q is not a CA certificate allowed to sign certificates", cert.Subject.CommonName)
	}
	key, err := parseECDSAKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA key: %w", err)
	}
	if !publicKeysMatch(key, cert.PublicKey) {
		return nil, fmt.Errorf("load CA: key does not belong to CA certificate %q", cert.Subject.CommonName)
	}
	canonKey, err := encodeKeyPEM(key)
	if err != nil {
		return nil, fmt.Errorf("load CA key: %w", err)
	}
	return &CA{cert: cert, key: key, certPEM: encodeCertPEM(cert.Raw), keyPEM: canonKey}, nil
}

// CertPEM returns the CA certificate; distribute it to every member as the trust root.
func (ca *CA) CertPEM() []byte { return bytes.Clone(ca.certPEM) }

// Signed reports, by an error, whether cert was issued (signed) by this CA: only those does its
// revocation list revoke.
func (ca *CA) Signed(cert *x509.Certificate) error { return cert.CheckSignatureFrom(ca.cert) }

// KeyPEM returns the CA private key (PKCS#8). Keep it off member hosts.
func (ca *CA) KeyPEM() []byte { return bytes.Clone(ca.keyPEM) }

// Issue signs a new ECDSA P-256 certificate for member, valid for validity
// and usable for both server and client authentication. The CN and a DNS SAN
// carry the member name; ips become IP SANs (informational: peers verify the
// name, not the address). The leaf may not outlive the CA.
func (ca *CA) Issue(member string, ips []netip.Addr, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	if validity <= 0 {
		return nil, nil, fmt.Errorf("issue certificate for %q: validity %v must be positive", member, validity)
	}
	now := time.Now()
	return ca.issue(member, ips, now.Add(-clockSkew), now.Add(validity))
}

func (ca *CA) issue(member string, ips []netip.Addr, notBefore, notAfter time.Time) (certPEM, keyPEM []byte, err error) {
	if err := ValidateMemberName(member); err != nil {
		return nil, nil, fmt.Errorf("issue certificate: %w", err)
	}
	if notAfter.After(ca.cert.NotAfter) {
		return nil, nil, fmt.Errorf("issue certificate for %q: it would expire %s, after the CA does (%s); shorten the validity or renew the CA",
			member, notAfter.UTC().Format(time.RFC3339), ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	ipSANs := make([]net.IP, 0, len(ips))
	for _, ip := range ips {
		if !ip.IsValid() {
			return nil, nil, fmt.Errorf("issue certificate for %q: invalid (zero) IP address", member)
		}
		ipSANs = append(ipSANs, net.IP(ip.Unmap().WithZone("").AsSlice()))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %q: generate key: %w", member, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %q: %w", member, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: member},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		DNSNames:              []string{member},
		IPAddresses:           ipSANs,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %q: sign: %w", member, err)
	}
	keyPEM, err = encodeKeyPEM(key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %q: %w", member, err)
	}
	return encodeCertPEM(der), keyPEM, nil
}
