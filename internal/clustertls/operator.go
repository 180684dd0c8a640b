package clustertls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"strings"
	"time"
)

// OperatorPrefix starts the common name of an operator certificate. ':' is
// outside the member-name alphabet, so PeerName rejects an operator
// certificate and no agent ever takes an operator for a member, whatever
// the operator is called.
const OperatorPrefix = "operator:"

// IssueOperator signs a client-only certificate (no server use, no DNS SAN)
// for the operator name (same alphabet as member names), CN "operator:name",
// for a cluster-wide ftctl. The leaf may not outlive the CA.
func (ca *CA) IssueOperator(name string, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	if err := ValidateMemberName(name); err != nil {
		return nil, nil, fmt.Errorf("issue operator certificate: operator %w", err)
	}
	if len(OperatorPrefix+name) > maxMemberName {
		return nil, nil, fmt.Errorf("issue operator certificate: operator name %q is longer than %d bytes (the common name %s%s is at most %d)",
			name, maxMemberName-len(OperatorPrefix), OperatorPrefix, name, maxMemberName)
	}
	if validity <= 0 {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: validity %v must be positive", name, validity)
	}
	now := time.Now()
	notAfter := now.Add(validity)
	if notAfter.After(ca.cert.NotAfter) {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: it would expire %s, after the CA does (%s); shorten the validity or renew the CA",
			name, notAfter.UTC().Format(time.RFC3339), ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: generate key: %w", name, err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: %w", name, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: OperatorPrefix + name},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: sign: %w", name, err)
	}
	keyPEM, err = encodeKeyPEM(key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue operator certificate for %q: %w", name, err)
	}
	return encodeCertPEM(der), keyPEM, nil
}

// OperatorName returns the operator name of a verified peer that presented
// an operator certificate, and fails for anything else (a member included).
func OperatorName(cs *tls.ConnectionState) (string, error) {
	if cs == nil || len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return "", errors.New("clustertls: peer has no verified certificate chain (handshake not done or not mutual TLS)")
	}
	cn := cs.VerifiedChains[0][0].Subject.CommonName
	name, ok := strings.CutPrefix(cn, OperatorPrefix)
	if !ok {
		return "", fmt.Errorf("clustertls: peer %q is not an operator", cn)
	}
	if err := ValidateMemberName(name); err != nil {
		return "", fmt.Errorf("clustertls: operator certificate CN: %w", err)
	}
	return name, nil
}
