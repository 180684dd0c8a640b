// Package clustertls authenticates ftkit agents to each other with mutual
// TLS 1.3. Every member holds a certificate signed by the cluster CA whose
// common name is its member name; identity is the name, never the address,
// because a spare host takes over a failed node's IP.
//
// Rotation: credentials are read from disk on every handshake (server side
// through GetConfigForClient; client side the certificate through
// GetClientCertificate and the CA when ClientTLS or Dial is called), so
// replacing the files takes effect for the next connection without a restart.
// Established connections keep the identity they were opened with. To rotate
// the CA, first put the old and new CA certificates together in CAFile, then
// re-issue member certificates, then drop the old CA.
package clustertls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// Config locates a member's credentials and says who may connect.
type Config struct {
	CAFile   string // PEM, one or more trusted cluster CA certificates
	CertFile string // PEM, this member's certificate (followed by any intermediates)
	KeyFile  string // PEM, this member's private key, PKCS#8 or SEC 1
	// CRLFile is optional: PEM X.509 CRLs signed by a CA of CAFile (ftctl pki revoke). A peer whose
	// certificate, or a sub-CA of whose chain, it lists is refused, member or operator; re-read on every
	// handshake like CAFile.
	CRLFile string
	// Members reports whether a verified peer name belongs to the cluster.
	// It is consulted on every inbound handshake, so membership changes
	// apply to the next connection. Required by ServerTLS.
	Members func(name string) bool
	// Operators reports whether a verified operator (a certificate with CN
	// "operator:NAME", see IssueOperator) may connect, by NAME. Nil refuses
	// every operator. Which operations an operator may call is the server's
	// business (clusterapi): the handshake only admits it.
	Operators func(name string) bool
}

// loadCAPool reads the trusted CA certificates from c.CAFile.
func (c Config) loadCAPool() (*x509.CertPool, error) {
	pool, _, err := c.loadCAs()
	return pool, err
}

// loadTrust reads the trusted CA certificates and what c.CRLFile revokes.
func (c Config) loadTrust() (*x509.CertPool, revocations, error) {
	pool, certs, err := c.loadCAs()
	if err != nil {
		return nil, nil, err
	}
	revoked, err := c.loadRevocations(certs)
	if err != nil {
		return nil, nil, err
	}
	return pool, revoked, nil
}

func (c Config) loadCAs() (*x509.CertPool, []*x509.Certificate, error) {
	data, err := os.ReadFile(c.CAFile)
	if err != nil {
		return nil, nil, fmt.Errorf("read CA file: %w", err)
	}
	certs, err := parseCertsPEM(data)
	if err != nil {
		return nil, nil, fmt.Errorf("CA file %s: %w", c.CAFile, err)
	}
	pool := x509.NewCertPool()
	for _, cert := range certs {
		if !cert.IsCA {
			return nil, nil, fmt.Errorf("CA file %s: certificate %q is not a CA certificate", c.CAFile, cert.Subject.CommonName)
		}
		pool.AddCert(cert)
	}
	return pool, certs, nil
}

// loadKeyPair reads this member's certificate and key, naming the file at fault.
func (c Config) loadKeyPair() (*tls.Certificate, error) {
	certData, err := os.ReadFile(c.CertFile)
	if err != nil {
		return nil, fmt.Errorf("read certificate file: %w", err)
	}
	certs, err := parseCertsPEM(certData)
	if err != nil {
		return nil, fmt.Errorf("certificate file %s: %w", c.CertFile, err)
	}
	keyData, err := os.ReadFile(c.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("read key file: %w", err)
	}
	key, err := parseKeyPEM(keyData)
	if err != nil {
		return nil, fmt.Errorf("key file %s: %w", c.KeyFile, err)
	}
	if !publicKeysMatch(key, certs[0].PublicKey) {
		return nil, fmt.Errorf("key file %s does not belong to certificate file %s (half-finished rotation? re-run and retry)", c.KeyFile, c.CertFile)
	}
	chain := make([][]byte, len(certs))
	for i, cert := range certs {
		chain[i] = cert.Raw
	}
	return &tls.Certificate{Certificate: chain, PrivateKey: key, Leaf: certs[0]}, nil
}

// ServerTLS returns a TLS 1.3 server configuration that demands a client
// certificate signed by the cluster CA, for client authentication, whose CN
// Members accepts. The files are validated now and re-read on every handshake.
func (c Config) ServerTLS() (*tls.Config, error) {
	if c.Members == nil {
		return nil, errors.New("server TLS: Config.Members is nil; supply the membership check (refusing to accept any CA-signed peer by default)")
	}
	// Fail at start-up, not at the first connection, on missing or bad files.
	if _, err := c.serverConfigForHandshake(); err != nil {
		return nil, fmt.Errorf("server TLS: %w", err)
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return c.serverConfigForHandshake()
		},
	}, nil
}

func (c Config) serverConfigForHandshake() (*tls.Config, error) {
	pool, revoked, err := c.loadTrust()
	if err != nil {
		return nil, err
	}
	cert, err := c.loadKeyPair()
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{*cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		// Resumption would skip re-reading the CA file; agent connections are
		// long-lived, so a full handshake each time costs little.
		SessionTicketsDisabled: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := revoked.checkPeer(&cs); err != nil {
				return err
			}
			if op, err := OperatorName(&cs); err == nil {
				if c.Operators == nil || !c.Operators(op) {
					return fmt.Errorf("clustertls: operator %q has a valid cluster certificate but this server accepts no such operator; refusing it", op)
				}
				return nil
			}
			name, err := PeerName(&cs)
			if err != nil {
				return err
			}
			if !c.Members(name) {
				return fmt.Errorf("clustertls: peer %q has a valid cluster certificate but is not a cluster member; refusing it", name)
			}
			return nil
		},
	}, nil
}

// ClientTLS returns a TLS 1.3 client configuration that accepts only a server
// presenting a certificate from the cluster CA for member expectPeer (CN and
// DNS SAN must both equal expectPeer; the dialled address is irrelevant). The
// CA is read now; the own certificate is re-read on every handshake. Use a
// fresh config per connection (Dial does) to pick up a rotated CA.
func (c Config) ClientTLS(expectPeer string) (*tls.Config, error) {
	if err := ValidateMemberName(expectPeer); err != nil {
		return nil, fmt.Errorf("client TLS: expected peer: %w", err)
	}
	pool, revoked, err := c.loadTrust()
	if err != nil {
		return nil, fmt.Errorf("client TLS: %w", err)
	}
	if _, err := c.loadKeyPair(); err != nil {
		return nil, fmt.Errorf("client TLS: %w", err)
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		RootCAs:    pool,
		// Standard verification checks the chain, server-auth EKU, expiry and
		// the member-name DNS SAN; VerifyConnection adds the CN check.
		ServerName: expectPeer,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return c.loadKeyPair()
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := revoked.checkPeer(&cs); err != nil {
				return err
			}
			name, err := PeerName(&cs)
			if err != nil {
				return err
			}
			if name != expectPeer {
				return fmt.Errorf("clustertls: server is member %q, expected %q; refusing it", name, expectPeer)
			}
			return nil
		},
	}, nil
}

// PeerName returns the member name (certificate CN) of the verified peer of
// a connection configured by this package. It fails if the peer's chain was
// not verified, so an unauthenticated name is never returned.
func PeerName(cs *tls.ConnectionState) (string, error) {
	if cs == nil || len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return "", errors.New("clustertls: peer has no verified certificate chain (handshake not done or not mutual TLS)")
	}
	name := cs.VerifiedChains[0][0].Subject.CommonName
	if err := ValidateMemberName(name); err != nil {
		return "", fmt.Errorf("clustertls: peer certificate CN: %w", err)
	}
	return name, nil
}
